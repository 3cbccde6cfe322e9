"""eagle3ft: harvest target features, fine-tune an EAGLE-3 drafter, prove the speed-up.

The stages live in the repository's top-level folders and are installed as
``eagle3ft.data``, ``eagle3ft.train`` and ``eagle3ft.eval``; what they share lives here,
the drafter itself (config, vocab, model, export format) in ``eagle3ft.drafter``.
"""

__version__ = "0.1.0"
