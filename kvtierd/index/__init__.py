"""The block index of a device pool and the slot index of a lower tier: what is cached where, who holds it, what leaves
next."""
