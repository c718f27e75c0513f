"""What the SDK tells a caller when it must not go on."""


class ReservoirError(Exception):
    """Base of the SDK's errors."""


class StaleClaimError(ReservoirError):
    """The claim moved on (settled, expired, replaced by a new attempt): the caller's view is
    stale and the action it wanted no longer applies."""


class LeaseUncertainError(ReservoirError):
    """The lease cannot be confirmed (expiring, or a renewal not acknowledged): stop
    starting irreversible work until the claim is read and renewed again."""


class ClaimNotFoundError(ReservoirError):
    """No such BranchClaim."""
