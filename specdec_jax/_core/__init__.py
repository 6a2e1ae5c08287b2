"""Primitives: the accept test, sampling, error codes, argument checks, keys, result types, tree
links."""
