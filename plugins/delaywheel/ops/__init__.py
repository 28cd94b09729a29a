"""Operating the store: cancel, figures (stats), caller-supplied predicates, progress."""
