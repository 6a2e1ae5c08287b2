"""The layouts: from logits, engine conventions, packed and packed-tree, mesh and vocab-parallel."""
