"""The precision advisor: ``mp.advise(model, batch)`` measures which layers of a model can take
bf16, fp16 or FP8, and what each costs, then turns that into a :class:`~mixprec.Policy`.

* :mod:`.capture`: the fp32 reference pass and passes that leave no trace on the model;
* :mod:`.measure`: one layer in one format (errors, ranges, the loss change);
* :mod:`.advice`: :class:`Advice` (``unsafe``, ``reasons``, ``policy``, ``table``, ``plot``);
* :mod:`.report`: the table and the plot;
* :mod:`.planted`: two models with a planted problem (fp16 overflow, an FP8 outlier).
"""

from .advice import Advice, LayerAdvice, Thresholds
from .advise import advise
from .measure import FORMATS, Measurement

__all__ = ["advise", "Advice", "LayerAdvice", "Thresholds", "Measurement", "FORMATS"]
