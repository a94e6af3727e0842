"""The cache service process: the metadata of every reusable snapshot and the byte budget.

The arrays stay in the worker (and in the spill files it writes); this process decides which
snapshots are kept (index.py) and answers the worker's lookups (service.py).
"""
