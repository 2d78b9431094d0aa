"""Selection: which engine runs a call (memory, disk cache, measurement, heuristic), the steady
path of repeated calls, the persistent cache and the ranks' agreement under torch.distributed."""
