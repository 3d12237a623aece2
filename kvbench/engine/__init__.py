"""The replay loops that drive the cache with a request stream."""
