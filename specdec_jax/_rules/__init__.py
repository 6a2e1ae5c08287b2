"""The rules: token-wise, block, tree (and its walk), and the registry every layout looks them up
in."""
