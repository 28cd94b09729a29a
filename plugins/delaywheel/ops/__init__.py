"""Operating the store: cancel, figures (stats), lateness quality, caller-supplied predicates, progress."""
