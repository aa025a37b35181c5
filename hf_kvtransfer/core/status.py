"""The words a transfer's status is told in, the same in transformers (`TransferredCache.transfer_status`) and in
the vLLM connector (each request's `kv_transfer_params`): `applied` (the request runs on transferred K/V),
`fallback` (the target computed it itself, with a reason), `unsupported` (the request cannot be transferred), `failed`
(the request ended with an error)."""

APPLIED, FALLBACK, UNSUPPORTED, FAILED = "applied", "fallback", "unsupported", "failed"

__all__ = ["APPLIED", "FAILED", "FALLBACK", "UNSUPPORTED"]
