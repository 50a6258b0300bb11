"""The message keys the server and the clients exchange, each declared once.

A strategy and its client hook import the same constant, so a key cannot be spelled
two ways. Arrays are named by state-dict key; a key ending in ``.`` is a prefix
(``proto.3``, ``extractor.conv2.weight``). FedLoRA's keys are its adapters' state-dict
keys, under ``models.adapter.ADAPTERS`` (the model's module name), imported by both
sides from there.
"""

HEAD = "head."
"""The classification head (``head.weight`` [C, d], ``head.bias`` [C]): lgfedavg,
fedgh, fedre, fedgen."""
PROTO = "proto."
"""One class prototype, ``proto.<c>`` [d]: fedproto, fedgh, fedtgp."""
LOGIT = "logit."
"""One class's mean logit vector, ``logit.<c>`` [C]: fd."""
GUIDE = "guide"
"""FedL2G's guide table, one guiding vector per class: [C, d] (fedl2g) or [C, C]
(fedl2gl)."""
GUIDE_GRAD = "guide-grad."
"""One row of the gradient of a client's quiz loss with respect to the guide table,
``guide-grad.<c>`` [d] or [C], for the classes of its study batch: fedl2g, fedl2gl."""
GENERATOR = "generator."
"""FedGen's feature generator (``generator.<state-dict key>``), trained on the server."""
LABEL_COUNTS = "label-counts"
"""Training samples per class [C] as float32 whole numbers: a fedgen client's own in
its reply, the pooled counts the generator was trained on in the server's message."""
REP = "rep"
"""FedRE's entangled representations [n, d]."""
SOFT_LABEL = "soft-label"
"""FedRE's soft labels of the entangled representations [n, C]."""
EXTRACTOR = "extractor."
"""FedARA's feature extractor, dense (``extractor.<key>``) or as factors
(``extractor.<layer>.U`` / ``.V``)."""
MEME = "meme."
"""FML's shared meme model (``meme.<state-dict key>``)."""
MENTEE = "mentee."
"""FedKD's shared mentee model (``mentee.<state-dict key>``)."""
SHARED = "shared."
"""FedMRL's small homogeneous model shared by every client (``shared.<state-dict
key>``: its extractor and its head ``Linear(s, C)``)."""
FACTOR_US, FACTOR_VT = ".us", ".vt"
"""Suffixes of a FedKD update sent as truncated-SVD factors: ``<key>.us`` [rows, r]
(U·S) and ``<key>.vt`` [r, cols]."""

EVAL_CONFIG = "evaluate-config"
"""A training message that also carries the previous round's evaluation
(``eval-mode = with-train``): the ConfigRecord the ``evaluate.<name>`` message would
have had (its ``server-round`` is the evaluated round)."""
EVAL_ARRAYS = "evaluate-arrays"
"""The ArrayRecord that evaluation needs, when it differs from the training message's
``arrays`` (FedARA's deadline policy can serve a node another tier for the next round);
absent when the two are equal."""
EVAL_METRICS = "evaluate-metrics"
"""The MetricRecord a ``evaluate.<name>`` reply would have had ("metrics"), sent in the
training reply of a message that carried :data:`EVAL_CONFIG`."""
