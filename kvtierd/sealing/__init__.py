"""KV at rest, sealed per tenant: the node's master key (master_key.py), the tenants' data keys it
wraps (tenant_keys.py) and where they are kept (key_directory.py), the AEAD that seals a block's
bytes and token ids under its tenant's key (block_seal.py), and master-key rotation (rotation.py).
The [encryption] section is encryption_config.py."""
