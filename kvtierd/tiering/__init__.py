"""Where blocks go between tiers: edge policies, offload down, promotion up, and the tier manager of one layout."""
