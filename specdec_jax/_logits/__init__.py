"""Logits to processed rows: sampling parameters, row edits, kept-set cuts, lazy statistics."""
