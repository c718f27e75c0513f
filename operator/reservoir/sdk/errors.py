"""What the SDK tells a caller when it must not go on."""


class ReservoirError(Exception):
    """Base of the SDK's errors."""


class StaleClaimError(ReservoirError):
    """The claim moved on (settled, expired, cancelled, being deleted, replaced by a new
    attempt, or held by another worker): the caller's view is stale and the action it wanted
    no longer applies."""


class LeaseUncertainError(ReservoirError):
    """The lease cannot be confirmed (expiring, a renewal not acknowledged, or the claim's
    Lease held by another holder): stop starting irreversible work until the claim is read
    and renewed again."""


class NotReservedError(ReservoirError):
    """The claim holds no capacity yet (still Pending, or not admitted at all): there is
    nothing to dispatch. Wait until it is Tentative, then try again."""


class ClaimNotFoundError(ReservoirError):
    """No such BranchClaim."""


class ClaimExistsError(ReservoirError):
    """`hold(name=...)` found a claim of that name that is not the one this call would
    create (another envelope, branch, attempt, requests, holder...), or one being deleted:
    it is not returned, and nothing was written. `differences` names each field that
    differs, as the API spells it."""

    def __init__(self, message: str, name: str = "", differences: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.differences = differences


class DuplicateRequestIdError(ReservoirError):
    """Another claim of the namespace already carries this `upstream.requestId`: the
    submission was made before. Use that claim (`claim` names it), or a new requestId for a
    new attempt. (The operator rejects such a claim anyway, with reason DuplicateRequestId:
    the SDK only says so before writing.)"""

    def __init__(self, message: str, claim: str = "") -> None:
        super().__init__(message)
        self.claim = claim


class CompensationError(ReservoirError):
    """A compensation that cannot be sent as asked (no amount, a zero amount, no reason, a
    key that names another compensation, a claim that already holds the most it keeps):
    nothing was written."""
