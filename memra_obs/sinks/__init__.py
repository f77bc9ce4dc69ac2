"""The sinks: the contract (:mod:`.base`), the legacy lines (:mod:`.stderr`), NVTX (:mod:`.nvtx`)."""
