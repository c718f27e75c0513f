"""Adapters between the Kubernetes API and the pure core. No ledger arithmetic here."""
