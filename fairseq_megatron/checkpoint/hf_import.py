"""Import from transformers (``fairseq-megatron-reshard --from-hf``).

Reads a transformers checkpoint directory of GPT-2, OPT or XGLM
(:mod:`.hf_architectures`; weights: :mod:`.hf_weights`) and writes it as
our checkpoint at any ``T x P`` layout the model divides: part files
``NAME-model_part-K[-stage-S].pt`` (``NAME.pt`` at size 1) whose config
records everything the architecture needs (``--decoder-learned-pos``,
``--activation-fn``, ``--no-scale-embedding``, the positions, the padded
vocabulary, the masked rows), and ``dict.txt`` beside them, in the order of
the embedding rows (:mod:`.hf_vocabulary`). Every tool then uses it as one
of our own checkpoints, with no further flag: fairseq-eval-lm, -generate,
-interactive, the hub, resharding, and fairseq-train from it
(``--finetune-from-model``, or ``--restore-file``, which starts a fresh
optimizer: the import holds no optimizer state).

Streaming: the source is read a layer at a time (safetensors maps its
files) and the output parts are built and written one at a time, so the
peak is about one output part plus one layer of the source. Each file is
written under a temporary name of its own and verified; a checkpoint in
several files is committed as a training save is (:mod:`.commit`: staged
names, a manifest, renames), one file renamed whole. Bad input is refused,
in one line, before anything is written.
"""

import contextlib
import json
import os
import warnings
from argparse import Namespace
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch

from fairseq_megatron.checkpoint import commit
from fairseq_megatron.checkpoint.hf_architectures import Architecture, architecture_of
from fairseq_megatron.checkpoint.hf_tokenizer import SPECIAL_SYMBOLS, read_gpt2_files
from fairseq_megatron.checkpoint.hf_vocabulary import VocabularyPlan, padding_multiple, read_dict_symbols
from fairseq_megatron.checkpoint.hf_weights import SourceWeights
from fairseq_megatron.checkpoint.layout import (
    BUFFER_NAMES,
    CheckpointError,
    model_on_meta,
    partition_dims_of_model,
    slice_for_part,
)
from fairseq_megatron.checkpoint.names import output_paths, staged_name
from fairseq_megatron.checkpoint.part_files import check_output_name, write_error
from fairseq_megatron.checkpoint.resharding import save_verified, split_stages, stage_layouts
from fairseq_megatron.errors import UsageError
from fairseq_megatron.files import written_whole

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CRITERION = "VocabParallelCrossEntropyCriterion"  # the class fairseq-train records for vocab_parallel_cross_entropy


class Import:
    """A transformers checkpoint in ``directory``, read and checked, ready to
    write at model-parallel size ``tensor`` in ``stages`` pipeline stages.

    Raises (on construction; nothing is written by then):
        UsageError / CheckpointError: no or a bad ``config.json``; an
            architecture or configuration field this package cannot express;
            missing, truncated or mismatched weight files; a tensor missing
            or of another shape; a tokenizer or BPE files that do not give
            GPT-2 BPE ids; fewer embedding rows than tokenizer entries;
            ``tensor`` not dividing the heads or the FFN size; ``stages`` not
            dividing the layers.
    """

    def __init__(self, directory: str, tensor: int, stages: int = 1, encoder_json: Optional[str] = None,
                 vocab_bpe: Optional[str] = None, dtype: Optional[str] = None):
        from fairseq_megatron.models.options import undivided_dimension

        if (encoder_json is None) != (vocab_bpe is None):
            raise UsageError("--encoder-json and --vocab-bpe go together: GPT-2's BPE is both files")
        if not os.path.isdir(directory):
            if os.path.exists(directory):
                raise UsageError(f"--from-hf {directory} is a file: give the directory that holds it and config.json")
            raise FileNotFoundError(f"--from-hf {directory}: no such directory")
        for flag, path in (("--encoder-json", encoder_json), ("--vocab-bpe", vocab_bpe)):
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        self.directory, self.tensor, self.stages = directory, tensor, stages
        self.dtype = DTYPES[dtype] if dtype else None
        config = _read_config(directory)
        self.weights = SourceWeights(directory)
        self.architecture: Architecture = architecture_of(config, directory)(config, self.weights, directory)
        self.architecture.check_tensors()
        self.options = self.architecture.options()
        heads, ffn = self.options["decoder_attention_heads"], self.options["decoder_ffn_embed_dim"]
        undivided = undivided_dimension(tensor, heads, ffn)
        if undivided is not None:
            what, _, n = undivided
            raise UsageError(f"--model-parallel-size {tensor} does not divide the {what} ({n}) of {directory}")
        encoder, merges = read_gpt2_files(encoder_json, vocab_bpe) if encoder_json else (None, None)
        self.vocabulary: VocabularyPlan = self.architecture.vocabulary(
            padding_multiple(heads, ffn), encoder, encoder_json, merges, vocab_bpe)
        stage_layouts(Namespace(**self.options), stages)  # refuses stages that do not divide the layers
        self.args = model_arguments(self.options, self.vocabulary, tensor, stages)
        self.template = model_on_meta(self.args, self.vocabulary.padded_vocab_size)
        self.shapes = {k: tuple(v.shape) for k, v in self.template.state_dict().items()}
        self.dims = partition_dims_of_model(self.template)
        self.tied = bool(self.options["share_decoder_input_output_embed"])

    # ------------------------------------------------------------ tensors

    def _checked(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            raise CheckpointError(f"{self.directory}: the weights of {key} are {str(tensor.dtype).replace('torch.', '')}, "
                                  f"not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{self.directory}: the weights of {key} hold NaN or infinite values")
        if key not in self.shapes:
            raise CheckpointError(f"the import made {key}, which {self.architecture.name}'s counterpart here lacks")
        if tuple(tensor.shape) != self.shapes[key]:
            raise CheckpointError(f"{self.directory}: {key} comes out {tuple(tensor.shape)}, the model here needs "
                                  f"{self.shapes[key]}")
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor

    def _rows(self, source: torch.Tensor) -> torch.Tensor:
        """``source`` ``(rows, C)`` laid out as our padded vocabulary ``(V, C)``:
        row r is the source row the plan names, zeros where none."""
        index = torch.tensor(self.vocabulary.source_rows)
        out = source.new_zeros(len(index), source.size(1))
        have = index >= 0
        out[have] = source[index[have]]
        return out

    def whole_groups(self):
        """Our whole (one-part) tensors, one group at a time: the embeddings,
        positions, final layer norm and output projection first, then each
        layer; each a dict of our keys."""
        embed_name, projection_name = self.architecture.embedding_names()
        first = {"decoder.embed_tokens.weight": self._rows(self.weights.get(embed_name))}
        if projection_name is not None:
            first["decoder.output_projection.weight"] = self._rows(self.weights.get(projection_name))
        first.update(self.architecture.read_others())
        for key, value in self.template.state_dict().items():
            if key.rsplit(".", 1)[-1] in BUFFER_NAMES:
                first[key] = value.detach().clone()  # fairseq's decoder version, the sinusoidal placeholder
        yield first
        for i in range(self.options["decoder_layers"]):
            yield {f"decoder.layers.{i}.{name}": t for name, t in self.architecture.read_layer(i).items()}

    def part(self, rank: int, progress: Optional[Callable[[], None]] = None) -> "OrderedDict[str, torch.Tensor]":
        """Model part ``rank`` of ``self.tensor``: its state dict, keys in our
        model's order, a tied output projection the embedding's tensor.

        Raises:
            CheckpointError: a tensor of the wrong shape, a key left out.
        """
        out = {}
        for group in self.whole_groups():
            for key, tensor in group.items():
                tensor = self._checked(key, tensor)
                dim = self.dims[key] if key in self.dims else None
                out[key] = tensor.clone() if dim is None else slice_for_part([tensor], dim, rank, self.tensor)
            del group
            if progress:
                progress()
        if self.tied:
            out["decoder.output_projection.weight"] = out["decoder.embed_tokens.weight"]
        missing = [key for key in self.shapes if key not in out]
        if missing:
            raise CheckpointError(f"the import of {self.directory} made no {missing[0]}")
        return OrderedDict((key, out[key]) for key in self.shapes)

    def state(self, rank: int, cfg: dict, progress=None) -> dict:
        """Checkpoint dict of part ``rank`` (before the pipeline split), as
        fairseq-train saves one, with nothing of training yet; ``cfg``:
        :func:`checkpoint_config`'s."""
        import copy

        from fairseq_megatron.checkpoint.resharding import set_model_parallel_size

        state = {
            "args": None, "cfg": copy.deepcopy(cfg), "model": self.part(rank, progress), "criterion": None,
            "optimizer_history": [{"criterion_name": CRITERION, "optimizer_name": None, "lr_scheduler_state": {},
                                   "num_updates": 0}],
            "task_state": {},
            "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True, "version": 2},
                            "previous_training_time": 0.0, "imported_from": self.architecture.name},
            "last_optimizer_state": None,
        }
        set_model_parallel_size(state, self.tensor, self.vocabulary.padded_vocab_size)
        return state

    # ------------------------------------------------------------ writing

    def write(self, output: str, verify: bool = True, progress: Optional[Callable[[], None]] = None) -> List[str]:
        """Write the checkpoint ``output`` (``NAME.pt``; parts and stages
        beside it) and ``dict.txt`` in its directory. Returns the files
        written, ``dict.txt`` last.

        Raises:
            CheckpointError / UsageError: an output name that is a directory or
                holds a checkpoint's files already, a ``dict.txt`` there of another
                vocabulary, a failed write (nothing is left of it) or
                verification.
        """
        outputs = output_paths(output, self.tensor, self.stages)
        check_output_name(output, outputs)
        existing = [f for f in [*outputs, commit.manifest_path(output)] if os.path.lexists(f)]
        if existing:
            raise UsageError(f"{existing[0]} exists: the import writes a new checkpoint and replaces none; choose "
                             f"another --output, or remove the checkpoint that is there")
        dict_path = os.path.join(os.path.dirname(os.path.abspath(output)), "dict.txt")
        write_dict = self._dictionary_to_write(dict_path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        except OSError as e:
            raise write_error(output, e) from None
        token = commit.new_token() if len(outputs) > 1 else None
        cfg = checkpoint_config(self.args, os.path.dirname(os.path.abspath(output)))
        written: List[str] = []  # temporary names, then staged names
        try:
            for rank in range(self.tensor):
                state = self.state(rank, cfg, progress)
                if token is not None:
                    state["extra_state"]["save"] = {"token": token, "updates": 0}
                for stage_state in split_stages(state, self.stages):
                    final = outputs[len(written)]
                    written.append(save_verified(stage_state, final, verify, rename=False))
                    if token is not None:
                        os.replace(written[-1], staged_name(final, token))
                        written[-1] = staged_name(final, token)
                del state
            if write_dict:
                self._write_dictionary(dict_path)
            if token is not None:
                commit.write_manifest(output, token, 0, outputs)  # the commit point
        except BaseException:
            for path in written:
                if os.path.lexists(path):
                    os.remove(path)
            raise
        _rename(written, outputs, token, output)
        return outputs + [dict_path]

    def _dictionary_to_write(self, dict_path: str) -> bool:
        """Whether ``dict_path`` is to be written: not where it holds this
        vocabulary already.

        Raises:
            UsageError: it holds another vocabulary.
        """
        if not os.path.exists(dict_path):
            return True
        if read_dict_symbols(dict_path) != self.vocabulary.symbols:
            raise UsageError(f"{dict_path} exists and holds another vocabulary than {self.directory}'s: write the "
                             f"import into another directory")
        return False

    def _write_dictionary(self, dict_path: str) -> None:
        try:
            with written_whole(dict_path) as partial:
                self.vocabulary.write_dict(partial)
        except OSError as e:
            raise write_error(dict_path, e) from None

    def groups(self) -> int:
        """The groups :meth:`whole_groups` yields per part (for a progress bar)."""
        return 1 + self.options["decoder_layers"]


def _rename(written: List[str], outputs: List[str], token: Optional[str], output: str) -> None:
    """Give the files ``written`` (temporary or staged names) their names
    ``outputs``, the save ``token``'s other staged files gone (a commit); one
    file without a token, and no manifest left of an earlier save in parts."""
    from fairseq_megatron.checkpoint.saving import remove_manifest

    for path, final in zip(written, outputs):
        os.replace(path, final)
        if token is not None:
            commit.remove_stale(final, token)
    if token is None:
        remove_manifest(output)


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} holds no config.json: not a transformers checkpoint directory") from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a transformers config (a JSON object)")
    return config


@contextlib.contextmanager
def _hydra_quietly():
    """Hold off the deprecation warnings of Hydra 1.3 that fairseq 0.12's
    configuration code draws each time it builds a config (it uses Hydra
    1.0's API; ``pytest.ini`` lists them): a user of this command has nothing
    to change about them."""
    with warnings.catch_warnings():
        for message in (r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
                        r"\s*The version_base parameter is not specified", r"In 'config'. Usage of deprecated keyword",
                        r"\s*'config' is validated against ConfigStore schema",
                        r"\s*The strict flag in the compose API is deprecated"):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def model_arguments(options: dict, vocabulary: VocabularyPlan, tensor: int, stages: int = 1) -> Namespace:
    """Our model's arguments as fairseq-train parses them for ``options``
    (:meth:`~.hf_architectures.Architecture.options`), ``vocabulary``,
    model-parallel size ``tensor`` and ``stages`` pipeline stages (with one
    micro-batch per stage, the fewest the schedule takes); the model's own
    checks run on them (``transformer_lm_megatron``'s architecture function).

    Raises:
        UsageError: what those checks refuse.
    """
    from fairseq import options as fairseq_options

    from fairseq_megatron.models.masked_vocab_rows import format_rows
    from fairseq_megatron.models.options import dictionary_checksum

    positions = str(options["max_target_positions"])
    flags = ["--task", "language_modeling", "--arch", "transformer_lm_megatron",
             "--criterion", "vocab_parallel_cross_entropy", "--sample-break-mode", "none",
             "--tokens-per-sample", positions, "--model-parallel-size", str(tensor),
             "--pipeline-model-parallel-size", str(stages), "--update-freq", str(stages),
             "--padded-vocab-size", str(vocabulary.padded_vocab_size)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, str(value)]
    if vocabulary.masked:
        flags += ["--masked-vocab-rows", format_rows(vocabulary.masked)]
    with _hydra_quietly():
        args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), input_args=["."] + flags)
    args.dictionary_size = vocabulary.dictionary_size
    args.dictionary_checksum = dictionary_checksum(list(SPECIAL_SYMBOLS) + vocabulary.symbols)
    return args


def checkpoint_config(args: Namespace, data: str) -> dict:
    """The ``cfg`` a fairseq-train save of a model built from ``args`` holds
    (``fairseq/trainer.py``, ``state_dict``), its data directory ``data``."""
    import copy

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    args = copy.deepcopy(args)
    args.data = data
    with _hydra_quietly():
        return OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)


def import_from_transformers(directory: str, output: str, tensor: int, stages: int = 1,
                             encoder_json: Optional[str] = None, vocab_bpe: Optional[str] = None,
                             dtype: Optional[str] = None, verify: bool = True,
                             progress: Optional[Callable[[], None]] = None) -> List[str]:
    """Write the transformers checkpoint in ``directory`` as our checkpoint
    ``output`` at model-parallel size ``tensor`` in ``stages`` pipeline
    stages (:class:`Import`), with ``dict.txt`` beside it; returns the files
    written. ``dtype``: one of :data:`DTYPES` (default: as stored).

    Raises:
        UsageError / CheckpointError / FileNotFoundError: as :class:`Import`
            and :meth:`Import.write`; nothing is written then.
    """
    return Import(directory, tensor, stages, encoder_json, vocab_bpe, dtype).write(output, verify, progress)
