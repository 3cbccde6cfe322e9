"""eagle3ft: harvest target features, fine-tune an EAGLE-3 drafter, prove the speed-up.

The stages live in the repository's top-level folders and are installed as
``eagle3ft.data``, ``eagle3ft.train`` and ``eagle3ft.eval``.
"""

__version__ = "0.1.0"
