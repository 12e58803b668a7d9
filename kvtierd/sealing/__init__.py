"""KV at rest, sealed per tenant: the node's master key (master_key.py), the tenants' data keys it
wraps (tenant_keys.py), and the AEAD that seals a block's bytes under its tenant's key
(block_seal.py). The [encryption] section is encryption_config.py."""
