"""The cache service process (snapshot metadata and the byte budget).

It arrives with the issue "The cache service and exact prefix reuse"; until then launch-stack
starts no cache process and the worker serves without reuse.
"""
