"""Model-card templates shipped with hf-kvtransfer (importable as `hf_kvtransfer.hub_cards` once installed)."""
