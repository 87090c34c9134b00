"""Pipeline parallelism: the model as DeepSpeed ``PipelineModule`` layers (``build_pipeline``).

Layers: the vocabulary (input side, ``VocabularyStage``) · every backbone block (``BlockStage``) · the final norm · the
vocabulary again (output side), whose ``PipelineLoss`` is the vocabulary's docs/spec.md §5 loss. The two vocabulary
layers are one ``TiedLayerSpec``: the first and last stage each hold the bucket tables (and the signature table), and
DeepSpeed sums the tables' gradients over the tie. Layers are LayerSpecs, built only on the stage holding them, each
materialising its part of the model skeleton (``mhf_dist.parallel.construct``). ``BalancedPipeline`` cuts the stages
by analytic forward FLOPs per layer (``flops``), the decoder's ``(2H−1)·B·d`` included. Engram memories (docs/spec.md
§8) live in their blocks; the token ids they hash travel beside the hidden states, ``(x, ids)``, and so they do to
every block of a model that masks documents (``data.document_masking``), whose stages each derive the documents'
positions and mask from them once per micro-batch (``StageInputs``). Why: docs/design-model.md, "Tensor and pipeline
parallelism".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from mhf_dist.backend.deepspeed.distributed import pipe_model_data_topology
from mhf_dist.model.backbone import Backbone, Block, block_inputs
from mhf_dist.model.documents import BlockInputs
from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.vocabulary import Evaluation, TiedVocabulary, TrainingLoss
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.stages import layer_costs, pipeline_bounds

VOCAB = "vocab"


class VocabularyStage(nn.Module):
    """The tied unit. On the first stage it receives token ids and embeds them (passing the ids on too when
    ``with_ids``); on the last it receives the final hidden states and passes them to the loss, which applies
    the decoder with the targets. (A ``forward_fn`` would pick the role too, but DeepSpeed then leaves the layer
    out of its checkpoints.)"""

    def __init__(self, vocab: TiedVocabulary, with_ids: bool = False):
        super().__init__()
        self.vocab, self.with_ids = vocab, with_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_floating_point():
            return x
        h = self.vocab.embed(x)
        return (h, x) if self.with_ids else h


class StageInputs:
    """The ``BlockInputs`` of a backbone's blocks on one stage (``block_inputs``). Without document masking each
    block computes its RoPE tables. With it, the first block of a micro-batch derives the documents' positions and
    mask from the token ids and the stage's later blocks reuse them: they receive the same ids tensor, which this
    keeps (so its identity cannot pass to another) with its version counter. A block recomputed in backward receives a
    copy of the ids, and derives them again."""

    def __init__(self, backbone: Backbone):
        self.head_dim, self.rope_theta = backbone.head_dim, backbone.rope_theta
        self.document_eos = backbone.document_eos
        self._ids: torch.Tensor | None = None
        self._key: tuple | None = None
        self._inputs: BlockInputs | None = None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor | None) -> BlockInputs:
        if self.document_eos is None:
            return block_inputs(x, ids, self.head_dim, self.rope_theta)
        key = (ids._version, x.dtype, x.device)
        if ids is not self._ids or key != self._key:
            self._inputs = block_inputs(x, ids, self.head_dim, self.rope_theta, self.document_eos)
            self._ids, self._key = ids, key
        return self._inputs


class BlockStage(nn.Module):
    """One backbone block, its RoPE tables (and document mask) from the stage's ``StageInputs``. It receives ``x`` or
    ``(x, ids)`` and passes the ids on only when ``keep_ids`` (a later block has a memory or masks documents)."""

    def __init__(self, block: Block, inputs: StageInputs, keep_ids: bool = False):
        super().__init__()
        self.block, self.keep_ids = block, keep_ids
        self.inputs = inputs  # shared by the stage's blocks

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]):
        x, ids = inputs if isinstance(inputs, tuple) else (inputs, None)
        cos, sin, positions, mask = self.inputs(x, ids)
        x = self.block(x, cos, sin, ids, positions, mask)
        return (x, ids) if self.keep_ids else x


class PipelineLoss:
    """``loss_fn(h, targets)`` on the last stage: the vocabulary's training loss (``TiedVocabulary.loss``, with the
    z-loss at ``z_loss_weight``), or inside ``evaluating`` its evaluation (``TiedVocabulary.evaluation``), their sums
    divided by ``divisor`` when set (document masking: the trainer's ``loss_divisor`` of the step or evaluation).
    Keeps each micro-batch's output in ``outputs``. DeepSpeed's pipeline engine calls the one ``loss_fn`` its module
    was built with, for ``train_batch`` and ``eval_batch`` alike, so the evaluation is chosen here."""

    def __init__(self, z_loss_weight: float = 0.0):
        self.z_loss_weight = z_loss_weight
        self.vocab: TiedVocabulary | None = None  # the last stage's, once the stage has made it
        self.outputs: list[TrainingLoss | Evaluation] = []
        self._temperatures: torch.Tensor | None = None  # evaluating at these
        self._eval_divisor: torch.Tensor | None = None  # and dividing by this
        self.wrap_loss: Callable[[torch.Tensor], torch.Tensor] | None = (
            None  # the trainer's, for a training loss
        )
        self.entropy = False  # a training loss also returns the heads' entropies (the step measures its health)
        self.divisor: torch.Tensor | None = None  # the step's (None: each micro-batch's count)
        self.count_targets: Callable[[torch.Tensor], None] | None = (
            None  # shown each training micro-batch's targets
        )
        self._scoring = False  # inside ``scoring``: per-row scores (``TiedVocabulary.row_scores``)

    def __call__(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._scoring:
            scores = self.vocab.row_scores(h, targets)
            self.outputs.append(scores)
            return scores[:, 0].sum().float()  # the engine's loss: the rows' NLL, as fp32
        if self._temperatures is None:
            if self.count_targets is not None:
                self.count_targets(targets)
            out = self.vocab.loss(h, targets, self.entropy, self.z_loss_weight, self.divisor)
            if self.wrap_loss is not None:
                out = out._replace(loss=self.wrap_loss(out.loss))
        else:
            out = self.vocab.evaluation(h, targets, self._temperatures, self._eval_divisor)
        self.outputs.append(out)
        return out.loss

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """The micro-batches of the block are scored row by row: ``outputs`` gets each one's float64 ``[B, 3]``
        (``TiedVocabulary.row_scores``)."""
        self._scoring = True
        try:
            yield
        finally:
            self._scoring = False

    @contextmanager
    def evaluating(
        self, temperatures: torch.Tensor, divisor: torch.Tensor | None = None
    ) -> Iterator[None]:
        """The micro-batches of the block are evaluated, with the sums at ``temperatures``, the loss's divided by
        ``divisor`` (None: each micro-batch's count)."""
        self._temperatures, self._eval_divisor = temperatures, divisor
        try:
            yield
        finally:
            self._temperatures = self._eval_divisor = None


def canonical_name(name: str) -> str:
    """A pipeline parameter's name in the LanguageModel's naming
    (``3.block.mlp...`` -> ``backbone.layers.2.mlp...``)."""
    if name.startswith(f"tied_modules.{VOCAB}."):
        return name[len(f"tied_modules.{VOCAB}.") :]
    index, _, rest = name.partition(".")
    if rest.startswith("block."):
        return f"backbone.layers.{int(index) - 1}.{rest[len('block.') :]}"
    return f"backbone.norm.{rest}"  # the only other layer with parameters


def pipeline_name(name: str, n_layers: int) -> str:
    """The inverse of ``canonical_name`` for a model of ``n_layers`` blocks."""
    if name.startswith("vocab."):
        return f"tied_modules.{VOCAB}.{name}"
    if name.startswith("backbone.layers."):
        index, _, rest = name[len("backbone.layers.") :].partition(".")
        return f"{int(index) + 1}.block.{rest}"
    return f"{n_layers + 1}.{name[len('backbone.norm.') :]}"


class LocalLayer(LayerSpec):
    """A pipeline layer made by ``make()``, which DeepSpeed calls only on the stage holding the layer."""

    def __init__(self, typename: type[nn.Module], make: Callable[[], nn.Module]):
        super().__init__(typename)
        self.make = make

    def build(self, log: bool = False) -> nn.Module:
        return self.make()


class TiedLocalLayer(TiedLayerSpec):
    """``LocalLayer`` for a tied layer (made once per stage holding it)."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        make: Callable[[], nn.Module],
        tied_weight_attr: list[str],
    ):
        super().__init__(key, typename, tied_weight_attr=tied_weight_attr)
        self.make = make

    def build(self, log: bool = False) -> nn.Module:
        return self.make()


class BalancedPipeline(PipelineModule):
    """Cuts the stages by analytic FLOPs per layer (``pipeline_bounds``) instead of parameter counts."""

    def __init__(self, *args, layer_costs: list[int], **kwargs):
        self._layer_costs = layer_costs
        super().__init__(*args, **kwargs)

    def _partition_layers(
        self, method: str = "uniform"
    ) -> None:  # called once by PipelineModule.__init__
        self.parts = pipeline_bounds(self._layer_costs, self.num_stages)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline(
    model: LanguageModel,
    groups: ParallelGroups,
    seq_len: int,
    materialise: Callable[[nn.Module], nn.Module] | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[PipelineModule, PipelineLoss]:
    """Cut a (tensor-parallel) ``model`` into the pipeline stages of ``groups``' grid, its blocks checkpointed as
    the model's backbone is built to be; returns the module and its loss function (with the z-loss at
    ``z_loss_weight``). ``materialise`` makes a part of ``model`` real (a ``Materialiser`` when
    ``model`` is a skeleton); it runs on the parts this stage holds only."""
    cfg = model.cfg
    real = materialise or (lambda module: module)
    loss = PipelineLoss(z_loss_weight)
    # the last block that reads the token ids: with document masking every block does
    last_reader = max(cfg.engram_layers, default=-1)
    if model.backbone.document_eos is not None:
        last_reader = cfg.n_layers - 1
    vocab_spec = TiedLocalLayer(
        VOCAB,
        VocabularyStage,
        lambda: VocabularyStage(real(model.vocab), last_reader >= 0),
        tied_weight_attr=["vocab.tables.weight"],
    )
    stage_inputs = StageInputs(model.backbone)  # this process holds one stage

    def block_layer(i: int, block: Block) -> LocalLayer:
        return LocalLayer(
            BlockStage, lambda: BlockStage(real(block), stage_inputs, keep_ids=i < last_reader)
        )

    layers = [vocab_spec]
    layers += [block_layer(i, block) for i, block in enumerate(model.backbone.layers)]
    layers += [LocalLayer(nn.RMSNorm, lambda: real(model.backbone.norm)), vocab_spec]
    costs = layer_costs(cfg, seq_len, model.vocab.tables.num_rows)
    pipe = BalancedPipeline(
        layers=layers,
        topology=pipe_model_data_topology(groups.pp, groups.tp, groups.dp),
        loss_fn=loss,
        layer_costs=costs,
        activation_checkpoint_interval=model.backbone.checkpoint_interval,
        checkpointable_layers=[BlockStage.__name__],
    )
    if VOCAB in pipe.tied_modules:  # the first and the last stage
        vocab = pipe.tied_modules[VOCAB].vocab
        loss.vocab = vocab
        stage, last = pipe.stage_id, pipe.num_stages - 1
        if stage != 0 and vocab.encoder is not None:
            vocab.encoder.requires_grad_(False)
        if stage != last:
            vocab.decoder.requires_grad_(False)
    return pipe, loss
