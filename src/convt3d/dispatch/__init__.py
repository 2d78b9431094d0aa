"""Which engine runs a call (memory, disk cache, measurement, heuristic), the steady path, the cache, rank agreement."""
