"""mixprec in other training loops: each integration drives one :class:`mixprec.MixedPrecision`.

* :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a Lightning precision plugin
  (``pip install 'mixprec[lightning]'``).
* :mod:`mixprec.integrations.transformers`: ``MixprecTrainer``, a Hugging Face
  ``transformers.Trainer`` (``pip install 'mixprec[transformers]'``).
* :mod:`mixprec.integrations.accelerate`: ``MixprecAccelerator``, a Hugging Face
  ``accelerate.Accelerator`` for a loop of your own (``pip install 'mixprec[accelerate]'``).

Importing this package imports neither library; each module imports its own when it is imported.
See docs/integrations.md for what each one covers.
"""

__all__: list[str] = []
