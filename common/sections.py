"""The run-config sections: one frozen pydantic model per dotted prefix.

``data.*``, ``model.*``, ``train.*``, ``privacy.*`` and each algorithm's own section
(``fedre.*``, ``fedara.*``, ...). Light on purpose: pydantic only, so the method
registry (:mod:`common.methods`) can name an algorithm's section without importing
the whole run-config model.

Every field's attribute docstring is its description (``use_attribute_docstrings``):
``python -m common.config_doc`` renders them into docs/configuration.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class Section(BaseModel):
    """Base of every section: frozen, unknown keys refused, kebab-case aliases, each
    field described by its attribute docstring."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=_kebab,
        populate_by_name=True,
        use_attribute_docstrings=True,
    )


class DataConfig(Section):
    """``data.*``: which dataset, how it is split over clients, where it lives."""

    name: Literal[
        "fashion-mnist",
        "cifar10",
        "cifar100",
        "tiny-imagenet",
        "npz",
        "imagefolder",
        "clients-npz",
        "synthetic",
    ] = "fashion-mnist"
    """The dataset: a named one, an ``npz`` file, an ``imagefolder`` tree, ``clients-npz``
    (a ready-made partition, one file per client) or ``synthetic`` (a small set for
    tests); where each is looked for: README, Data."""
    root: str = ""
    """Dataset location (the file for ``npz``, the folder for ``imagefolder`` and
    ``clients-npz``); empty = the dataset's default places (README, Data)."""
    partition: Literal["dirichlet", "pathological", "iid"] = "dirichlet"
    """How samples are split over clients: ``dirichlet`` (label shares drawn with
    concentration ``data.alpha``), ``pathological`` (``data.classes-per-client`` classes
    each) or ``iid``."""
    alpha: float = Field(0.1, gt=0)
    """Dirichlet concentration of the ``dirichlet`` partition; smaller = more skewed
    label distributions."""
    classes_per_client: int = Field(2, ge=1)
    """Classes each client holds under the ``pathological`` partition."""
    protocol: Literal["merge", "official"] = "merge"
    """``merge``: the official train and test sets are pooled and each client's share is
    split into local train and test (HtFLlib); ``official``: only the official train set
    is partitioned."""
    fraction: float = Field(1.0, gt=0, le=1)
    """Keep a seeded, stratified fraction of the dataset; 1 = all of it."""
    download: bool = False
    """Let torchvision download a missing dataset into ``data.root``."""
    train_fraction: float = Field(0.75, gt=0, lt=1)
    """Share of each client's samples used for local training (rest: local test)."""
    min_train_samples: int = Field(10, ge=1)
    """Minimum local training samples per client; a split that cannot give every
    client this many stops with an error naming the key."""
    min_test_samples: int = Field(2, ge=1)
    """Minimum local test samples per client (as ``data.min-train-samples``)."""
    cache_dir: str = ""
    """Where computed partitions are cached; empty = ``~/.cache/fedhet/partitions``."""
    image_size: int = Field(0, ge=0)
    """Side in pixels the images are resized to (bilinear) as a node loads them; 0 = as
    they are, except images smaller than 16 px (the smallest input of the model
    families' stems), which go up to 16 px (one log line says so). Must be 0 for
    feature vectors."""


class ModelConfig(Section):
    """``model.*``: the model family and the unified representation size ``d``."""

    family: str = "cnn"
    """A family name (``cnn``: CNN-1..5; ``fedavgcnn``; ``htfe``; ``htfe8``; ``mlp``:
    MLP-1..5 for feature vectors; README, Models) or a comma-separated list of
    architecture names, assigned round-robin by partition id."""
    feature_dim: int = Field(0, ge=0)
    """Unified representation size ``d``; 0 = the family's natural ``d`` (500 for
    ``cnn``, 128 for ``mlp``, 512 otherwise)."""
    small_input_stem: bool = True
    """torchvision nets get a 3×3 stride-1 first conv and no max-pool (for 28–32 px
    images)."""
    policy: Literal["profile", "deadline"] = "profile"
    """How a node with a device class (``fleet`` or node-config ``profile``) picks its
    architecture: ``profile``: the class's; ``deadline``: the largest of the family
    whose predicted round time meets ``round-deadline-s`` (chosen before round 1)."""
    init: Literal["per-client", "shared"] = "per-client"
    """Initial weights: ``per-client`` (seeded by (seed, partition)) or ``shared``
    (every client of an architecture starts from the same weights, seeded by
    (seed, architecture), as HtFLlib and FedAvg do)."""

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str) -> str:
        from models.families import family_archs  # lazy: keeps config import light

        family_archs(family)  # raises ValueError naming model.family and the choices
        return family


class TrainConfig(Section):
    """``train.*``: the shared local training loop (SGD)."""

    local_epochs: int = Field(1, ge=1)
    """Local training epochs per round."""
    batch_size: int = Field(10, ge=1)
    """Local batch size."""
    lr: float = Field(0.01, gt=0)
    """SGD learning rate."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum; 0 = none."""
    weight_decay: float = Field(0.0, ge=0)
    """SGD weight decay; 0 = none."""
    num_threads: int = Field(1, ge=0)
    """Torch intra-op threads per client process; 0 = leave torch's default."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where clients train; ``auto`` = CUDA when available, else the CPU (a node's
    profile may choose instead)."""


class FedREConfig(Section):
    """``fedre.*``: server-side head training on entangled representations."""

    server_lr: float = Field(0.01, gt=0)
    """SGD learning rate of the server's head training."""
    server_epochs: int = Field(1, ge=1)
    """Server epochs per round over the received (representation, soft label) pairs."""
    server_batch_size: int = Field(32, ge=1)
    """Batch size of the server's head training."""
    server_loss: Literal["mean", "sum"] = "mean"
    """Soft-label cross-entropy of a server batch: averaged over the batch, or summed
    (the published code's, a step ``batch`` times larger at the same lr)."""
    mix: Literal["rap", "vap", "rsr"] = "rap"
    """``rap``: random weights over class prototypes (the paper's default);
    ``vap``: equal weights over prototypes; ``rsr``: random weights over raw
    sample representations."""
    reps_per_client: int = Field(1, ge=1)
    """Entangled representations each client uploads per round (independent weight
    draws; the paper: 1); the upload is n·(d + C)·4 bytes."""


class FedProtoConfig(Section):
    """``fedproto.*``: prototype regularisation strength and inference rule."""

    lam: float = Field(10.0, ge=0, alias="lambda")
    """Weight λ of the client's MSE between a representation and the global prototype
    of its class; 0 = none."""
    infer: Literal["head", "proto"] = "head"
    """How a client predicts: ``head`` (its classifier) or ``proto`` (the nearest
    global prototype)."""


class FedGHConfig(Section):
    """``fedgh.*``: server-side head training on class prototypes."""

    server_lr: float = Field(0.01, gt=0)
    """SGD learning rate of the server's head training."""
    server_epochs: int = Field(100, ge=1)
    """Server epochs per round over the received (prototype, class) pairs (HtFLlib's)."""
    server_batch_size: int = Field(10, ge=1)
    """Batch size of the server's head training (HtFLlib's)."""


class FedTGPConfig(Section):
    """``fedtgp.*``: prototype regularisation on the client, trainable global
    prototypes with an adaptive margin on the server."""

    lam: float = Field(10.0, ge=0, alias="lambda")
    """Weight λ of the client's MSE between a representation and the generated
    prototype of its class; 0 = none."""
    server_epochs: int = Field(100, ge=1)
    """Epochs of the server's prototype-generator training per round."""
    server_lr: float = Field(0.01, gt=0)
    """SGD learning rate of the generator."""
    server_batch_size: int = Field(10, ge=1)
    """Received prototypes per generator step."""
    margin_threshold: float = Field(100.0, ge=0)
    """Cap of the adaptive margin in the generator's contrastive loss."""
    hidden_dim: int = Field(0, ge=0)
    """Width of the generator's hidden layer; 0 = d."""


class FedKDConfig(Section):
    """``fedkd.*``: the shared mentee and the energy its SVD-compressed update keeps."""

    mentee_arch: str = ""
    """Architecture of the shared mentee; empty = the family's smallest (``cnn-5`` for
    ``cnn``)."""
    energy_start: float = Field(0.95, gt=0, le=1)
    """Share of Σσ² each matrix of the mentee's update keeps after SVD compression, in
    round 1."""
    energy_end: float = Field(0.98, gt=0, le=1)
    """The same share in the last round (linear in between)."""


class FMLConfig(Section):
    """``fml.*``: the shared meme model and the two mutual-learning weights."""

    meme_arch: str = ""
    """Architecture of the shared meme model; empty = the family's smallest."""
    alpha: float = Field(0.5, ge=0, le=1)
    """The own model's loss: α·CE + (1−α)·KL(meme‖own)."""
    beta: float = Field(0.5, ge=0, le=1)
    """The meme's loss: β·CE + (1−β)·KL(own‖meme)."""


class FDConfig(Section):
    """``fd.*``: federated distillation's pull towards the global mean logits."""

    lam: float = Field(1.0, ge=0, alias="lambda")
    """Weight λ of the distillation term between a sample's logits and the global mean
    logit vector of its class (the paper's and HtFLlib's 1); 0 = none."""
    loss: Literal["kl", "mse"] = "kl"
    """The distillation term: ``kl``, KL(softmax(global logits of y) ‖ softmax(logits))
    (the global logits as a soft teacher), or ``mse``, the mean squared distance of the
    logit vectors (HtFLlib's before 2025-11)."""


class FedMRLConfig(Section):
    """``fedmrl.*``: the small shared model and the nested representation it reads."""

    shared_arch: str = ""
    """Architecture of the small homogeneous model every client shares; empty = the
    family's smallest (``cnn-5`` for ``cnn``)."""
    rep_dim: int = Field(128, ge=1)
    """``s``: the shared model's representation size (its ``RM`` pools to ``s``) and the
    leading coordinates of the fused representation its head reads (HtFLlib's
    ``sub_feature_dim``, 128); at most ``d``."""
    predict_head: Literal["own", "shared", "both"] = "shared"
    """The head(s) a node predicts with (and is evaluated and exported with): ``shared``,
    the shared head on the first ``s`` coordinates of the fused representation
    ``h(r[:, :s])``, ``own``, its own head ``h_k(r)`` (the paper's and HtFLlib's), or
    ``both``, the sum of the two heads' logits. Training is the same for all three.
    ``shared`` by the scarce suite (3 seeds): 0.7936 against ``own`` 0.7776 (below
    ``local``'s 0.7898) and ``both`` 0.7851 (docs/algorithms.md)."""
    predict_with: Literal["sent", "trained"] = "sent"
    """The shared model a node predicts (and is evaluated and exported) with: ``sent``,
    the server's mean it was sent (HtFLlib's), or ``trained``, the node's own copy as
    its last local training left it (the one its projector and head were trained
    with)."""


class FedGenConfig(Section):
    """``fedgen.*``: the server's feature generator and the client's term on its output."""

    noise_dim: int = Field(512, ge=1)
    """Width m of the generator's noise input ε ~ N(0, I) (HtFLlib's 512)."""
    hidden_dim: int = Field(512, ge=1)
    """Width H of the generator's hidden layer (HtFLlib's 512); the generator has
    (m + C)·H + 4·H + H·d + d numbers, sent to every client each round."""
    server_iterations: int = Field(100, ge=1)
    """Adam steps of the server's generator training per round (HtFLlib's 100)."""
    server_batch_size: int = Field(10, ge=2)
    """Labels per generator step (HtFLlib's 10, its client batch size)."""
    server_lr: float = Field(0.0003, gt=0)
    """Adam learning rate of the generator (the FedGen authors' 3e-4; HtFLlib's 0.005
    made worse clients in a 3-seed comparison: docs/results/small-fleets.md)."""
    diversity: float = Field(1.0, ge=0)
    """Weight η of the FedGen authors' diversity term in the generator's loss (their
    released code's 1; HtFLlib has none: 0)."""
    weight: float = Field(1.0, ge=0)
    """Weight of the client's cross-entropy of its head on generated features (HtFLlib's
    1); 0 = none (then the method is LG-FedAvg with extra traffic)."""


class FedL2GConfig(Section):
    """``fedl2g.*``: the guide table's meta step on the clients and its SGD step on the
    server (FedL2G-f, guiding vectors in the representation space)."""

    server_lr: float = Field(0.01, gt=0)
    """Learning rate of the server's SGD step on the guide table (HtFLlib's 0.01, at
    which the table barely moves; rates at which it moves were no better in a 3-seed
    comparison: docs/results/small-fleets.md)."""
    grad_clip: float = Field(100.0, ge=0)
    """Bound on the Frobenius norm of the aggregated gradient table before the step
    (HtFLlib's ``clip_grad_norm_`` at 100: the whole table's norm, not each value's or
    row's); 0 = no clipping."""
    study_batches: int = Field(1, ge=1)
    """Training batches (of ``train.batch-size``) in the meta step's study loss, drawn
    afresh each round from the client's training part (HtFLlib's 1)."""
    quiz_batches: int = Field(1, ge=1)
    """Batches of held-out quiz samples: ``quiz-batches`` × ``train.batch-size``
    training samples of each client (at most half of them), drawn once per run and
    node, never trained on (HtFLlib's 1)."""
    warm_up_rounds: int = Field(0, ge=0)
    """First rounds in which clients do not train, only take the meta step and upload
    its gradient (HtFLlib's 50; 0 = none, the default: at the server's learning rate
    the table barely moves in them, docs/algorithms.md)."""


class FedL2GLConfig(FedL2GConfig):
    """``fedl2gl.*``: the same settings for FedL2G-l, guiding vectors in the logit
    space (a C × C table)."""


class RobustConfig(Section):
    """``robust.*``: aggregation that a few extreme finite replies cannot steer."""

    aggregate: Literal["mean", "trimmed-mean", "median"] = "mean"
    """How the methods whose server averages arrays (fedavg, lgfedavg, fedlora, fml,
    fedkd's updates, fedproto's class prototypes, fd's logits, fedl2g's and fedl2gl's
    guide-gradient rows) combine the replies, coordinate by coordinate: the weighted
    ``mean``, a weighted ``trimmed-mean`` (``robust.trim`` of the weight cut from each
    end) or the weighted ``median``."""
    trim: float = Field(0.1, ge=0, lt=0.5)
    """Share of the total weight cut from each end by ``trimmed-mean``."""
    max_norm_ratio: float = Field(50.0, ge=0)
    """Reject an upload whose size, in the form the server aggregates (a parameter
    upload's update to what it was sent, FedARA's reconstructed; a prototype's or
    representation's norm), is more than this many times the round's median size
    (rounds with at least 3 uploads); 0 = off. The default is twice the largest
    honest ratio measured (docs/robustness.md), rounded up."""
    min_cosine: float = Field(-1.0, ge=-1, le=1)
    """Reject a parameter upload (fedavg, lgfedavg, fedlora, fml, fedara's
    reconstructed update) whose update has a cosine below this with the round's
    coordinate-wise median update: it points away from what the round agrees on
    (a sign-flipped update has about minus the honest cosine); -1 = off. Two passes:
    the second against the median of the updates the first kept. FedARA's replies are
    judged on their reconstructed update and on the tensors every tier sends whole."""
    prototypes: Literal["none", "screen", "median"] = "screen"
    """Per-class screening before the servers of fedgh, fedtgp and fedre train on
    the uploads. ``screen``: a prototype is dropped when its cosine with the
    coordinate-wise median of its class's prototypes is below
    ``robust.prototype-min-cosine`` or its norm is above
    ``robust.prototype-max-norm-ratio`` × the class's median norm (fedre: a reply,
    against the mix of per-class medians and median norms its soft label gives).
    ``median``: the same screening, then fedgh and fedtgp train on each class's
    median of the prototypes kept, in place of each (fedre: as ``screen``).
    ``none``: every valid upload is trained on as sent. On by default: it dropped no
    honest upload in the clean runs measured (docs/robustness.md)."""
    prototype_min_cosine: float = Field(0.0, ge=-1, le=1)
    """``robust.prototypes``: the lowest cosine a prototype may have with its class's
    median (features are non-negative, so honest ones have a positive cosine)."""
    prototype_max_norm_ratio: float = Field(10.0, ge=0)
    """``robust.prototypes``: the largest norm a prototype may have, in multiples of
    its class's median norm; 0 = no norm test."""


class PrivacyConfig(Section):
    """``privacy.*``: protection of what leaves a device."""

    clip: float = Field(0.0, ge=0)
    """L2 bound of every uploaded representation vector (FedRE's entangled
    representation, FedProto/FedGH/FedTGP prototypes) and per-class row (FD's mean
    logits, FedL2G's guide-gradient rows); 0 = off."""
    noise: float = Field(0.0, ge=0)
    """Gaussian noise added to each such vector: σ = noise × clip per element (seeded by
    seed, round and partition); 0 = none."""
    dp_clip: float = Field(0.0, ge=0)
    """Parameter uploads (the algorithms that upload what they were sent: fedavg,
    lgfedavg, fedlora, fml, fedara): Flower's LocalDpMod with this clipping norm of the
    update (0 = off)."""
    dp_epsilon: float = Field(1.0, gt=0)
    """LocalDpMod's ε (used when ``privacy.dp-clip`` > 0)."""
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    """LocalDpMod's δ (used when ``privacy.dp-clip`` > 0)."""


class LogConfig(Section):
    """``log.*``: where a run's metrics go while it runs, besides results.json."""

    tensorboard: str = ""
    """A folder for TensorBoard event files (needs ``pip install 'fedhet[tensorboard]'``):
    every completed round's metrics are written to ``<folder>/<out-dir's name>`` as the
    run goes, in simulation and deployment (the ServerApp writes them); view with
    ``tensorboard --logdir <folder>``. Empty = off."""


class FedARAConfig(Section):
    """``fedara.*``: rank tiers, decomposed layers, anchor loss."""

    rank_tiers: str = "1,0.5,0.25,0.125,0.0625"
    """Rank ratios assigned round-robin by partition id (node-config ``rank-ratio`` or
    the node's profile take precedence)."""
    rank_policy: Literal["profile", "deadline"] = "profile"
    """``profile``: a node keeps its rank ratio (node-config, its device class's, or
    its tier); ``deadline``: each round the server serves each node the largest tier
    of ``rank-tiers`` whose predicted round time meets ``round-deadline-s`` (its
    compute measured in earlier rounds, scaled by the tier's FLOPs)."""
    layers: str = ""
    """Comma-separated extractor layers to factorise; empty = the two largest
    factorisable layers, first conv excluded."""
    base_arch: str = ""
    """Architecture every client starts from; empty = the first of model.family."""
    lam: float = Field(2.0, ge=0, alias="lambda")
    """Anchor-loss weight λ, reached after the warm-up; 0 = no anchor loss."""
    warmup_rounds: int = Field(10, ge=0)
    """Rounds W of the anchor weight's warm-up, λ_t = λ·min(1, (t−1)/W); 0 = the full λ
    from round 2 (round 1 never has an anchor term)."""
    frobenius_decay: float = Field(1e-3, ge=0)
    """μ of the Frobenius decay μ·Σ‖U Vᵀ‖²_F of the factorised layers; 0 = off."""
    decay_every: int = Field(0, ge=0)
    """Apply the Frobenius decay as one closed-form step every this many SGD steps
    (with weight μ·steps); 0 = once at the end of every epoch."""
    aggregation: Literal["reconstruct", "delta", "coverage"] = "coverage"
    """``reconstruct``: sample-weighted mean of the reconstructed uploads (the
    paper's text); ``delta``: the global plus the weighted mean of each client's
    change to what its tier was served; ``coverage``: ``delta`` with each singular
    direction's update averaged over the clients whose rank covers it."""
    served_scale: Literal["none", "energy"] = "energy"
    """``none``: a tier gets the truncated SVD ``W_r`` (the paper); ``energy``: the
    factors are scaled so ``‖U Vᵀ‖_F = ‖W‖_F`` (``g·W_r``), and what the tier returns
    is divided by ``g`` before aggregation."""
    truncation: Literal["svd", "tracked"] = "tracked"
    """``svd``: a tier is served the truncated SVD of the global layer (the paper);
    ``tracked``: the projection onto r directions that follow the previous round's (one
    step of subspace iteration per global state, from the first round's SVD), so a
    tier's subspace does not jump where the spectrum is flat (better on every scarce
    seed, 11 points better in the practical regime; docs/results/methods.md)."""
    anchor_reduction: Literal["mean", "sum"] = "mean"
    """``mean``: MSE averaged over the d elements; ``sum``: squared L2 distance per
    sample, averaged over the batch (d times ``mean``)."""
    server_lr: float = Field(3.0, gt=0)
    """η in ``W ← W + η (W_rule − W)``, ``W_rule`` being what the aggregation rule makes
    of the replies (every extractor tensor): 1 = the rule as is (the paper); 3 was the
    best of 1, 2, 3, 5 in the scarce benchmark (docs/results/methods.md)."""
    server_step: Literal["bounded", "fixed"] = "bounded"
    """``bounded``: η at most max(1 / the replies' update coherence, √replies / 2), at
    least 1: with 50 replies η stays ``fedara.server-lr``; with 2-8 agreeing nodes and
    long local training the fixed η = 3 overshot (a round-2 collapse:
    docs/results/small-fleets.md). ``fixed``: η as set, every round."""

    @field_validator("rank_tiers")
    @classmethod
    def _check_tiers(cls, text: str) -> str:
        try:
            tiers = [float(t) for t in text.split(",") if t.strip()]
        except ValueError:
            tiers = []
        if not tiers or any(not 0 < t <= 1 for t in tiers):
            raise ValueError("must be comma-separated rank ratios in (0, 1], e.g. '1,0.5,0.25'")
        return text

    def tiers(self) -> list[float]:
        return [float(t) for t in self.rank_tiers.split(",") if t.strip()]

    def layer_list(self) -> list[str]:
        return [name.strip() for name in self.layers.split(",") if name.strip()]


class FedLoRAConfig(Section):
    """``fedlora.*``: the homogeneous low-rank adapter and the two phases."""

    rank: int = Field(8, ge=1)
    """Adapter rank r."""
    alpha: float = Field(8.0, gt=0)
    """LoRA scaling α: the branch is (α/r)·B A."""
    targets: str = "head"
    """Comma-separated places that get a LoRA branch: ``head`` (parallel to the
    head), ``rep`` (a residual d→d branch on the representation the head reads),
    and/or d→d Linear layers every client has (e.g. ``extractor.fc2``)."""
    local_epochs: int = Field(1, ge=1)
    """E₁: epochs on the local model per round, adapter frozen."""
    adapter_epochs: int = Field(1, ge=1)
    """E₂: epochs on the adapter per round, local model frozen (in eval mode)."""
    lr: float = Field(0.0, ge=0)
    """SGD learning rate of the adapter phase; 0 = ``train.lr``."""

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]
