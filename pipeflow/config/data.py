"""The data schemas: one typed config per data source (``data=markov|text|tokens|chat|gaussian|
cifar10|mnist|imagefolder|fakedata``), each holding only the keys its source reads, so a key
another source takes (``data=chat data.level=byte``) fails while composing, naming chat's keys.

The keys several sources share live in the classes they derive from: every source has a name, a
batch size and a seed; token sources a sequence length and a validation share; file sources a
path and a held-out path; image sources a side and a class count.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.config.choices import Overlong, TextLevel, TokenDtype


@dataclass
class DataConfig:
    """Where batches come from: ``markov`` (made locally), ``text`` (a local file), ``tokens``
    (token files read through memory maps), ``chat`` (conversations, prompts masked), ``gaussian``,
    or images: ``cifar10``, ``mnist``, ``imagefolder`` (under ``data.root``), ``fakedata``."""

    source: ClassVar[str | None] = None  # the data.name this schema is for (None: the common base)

    name: str = "markov"  # the source: set by data=<name>
    batch_size: int = 32  # rows of a global batch (split over dp ranks, then micro-batches)
    seed: int = 1234  # the sample order (validation batches: seed + 1)

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`pipeflow.config.schema.typed_config`)."""
        if self.source is not None and self.name != self.source:
            raise ConfigError(f"data.name={self.name!r} does not name this schema's source ({self.source}): choose "
                              f"the source with data=<name> ({', '.join(DATA_SCHEMAS)}), not data.name")


@dataclass
class TokenDataConfig(DataConfig):
    """Token sequences (markov, text, tokens, chat): rows of ``seq_len`` next-token targets."""

    seq_len: int = 64  # positions per row (model=gpt's block_size reads it)
    val_fraction: float = 0.1  # the last share of the data held out for validation
    variable_lengths: bool = False  # each micro-batch its own sequence length
    min_seq_len: int | None = None  # with variable_lengths: lengths from min_seq_len..seq_len (null: seq_len // 4)


@dataclass
class FileDataConfig(TokenDataConfig):
    """Token sequences read from files (text, tokens, chat)."""

    path: str | None = None  # a file, folder or glob (data=text: one text file)
    # held-out data (data.path's formats) train.eval_every evaluates on; null: data.path's last val_fraction
    eval_path: str | None = None


@dataclass
class MarkovDataConfig(TokenDataConfig):
    """``data=markov``: a token stream from a seeded sparse Markov chain, made locally."""

    source: ClassVar[str | None] = "markov"
    name: str = "markov"
    vocab_size: int = 64  # token ids (model=gpt's vocab_size reads it)
    num_tokens: int = 200_000  # length of the stream (the last val_fraction held out)


@dataclass
class TextDataConfig(FileDataConfig):
    """``data=text``: a local text file, a token per byte or per character."""

    source: ClassVar[str | None] = "text"
    name: str = "text"
    level: TextLevel = TextLevel.byte  # byte (vocabulary 256) or char (the file's characters)
    vocab_size: int = 256  # model=gpt's vocab_size (char level: at least the file's characters)


@dataclass
class TokensDataConfig(FileDataConfig):
    """``data=tokens``: token files through memory maps; the vocabulary is the model's."""

    source: ClassVar[str | None] = "tokens"
    name: str = "tokens"
    token_dtype: TokenDtype = TokenDtype.uint16  # the dtype of headerless files (.npy files carry their own)
    pack_documents: bool = False  # inputs (tokens, document ids), documents split at eos_id
    eos_id: int | None = None  # the end-of-document id (checked against model.vocab_size)


@dataclass
class ChatDataConfig(FileDataConfig):
    """``data=chat``: conversations tokenised with the model's chat template, prompts masked."""

    source: ClassVar[str | None] = "chat"
    name: str = "chat"
    tokenizer: str | None = None  # the folder of the tokenizer and chat template (null: model.path)
    pack_documents: bool = True  # whole conversations packed into rows, attention never crossing them
    overlong: Overlong = Overlong.drop  # what a conversation longer than seq_len + 1 tokens becomes


@dataclass
class GaussianDataConfig(DataConfig):
    """``data=gaussian``: Gaussian clusters for classifiers (model=mlp)."""

    source: ClassVar[str | None] = "gaussian"
    name: str = "gaussian"
    in_features: int = 32  # width of a sample (model=mlp reads it)
    num_classes: int = 10  # classes (a classifier's model.num_classes reads it)


@dataclass
class ImageDataConfig(DataConfig):
    """Images (cifar10, mnist, imagefolder, fakedata)."""

    image_size: int | None = None  # side of the square images (null: the data set's own; imagefolder 224)
    num_classes: int = 10  # classes (a classifier's model.num_classes reads it)


@dataclass
class Cifar10DataConfig(ImageDataConfig):
    """``data=cifar10``: CIFAR-10 under data.root (torchvision's on-disk format)."""

    source: ClassVar[str | None] = "cifar10"
    name: str = "cifar10"
    root: str = "data"  # the folder holding the data set
    download: bool = False  # let torchvision fetch it into data.root (needs internet)


@dataclass
class MnistDataConfig(Cifar10DataConfig):
    """``data=mnist``: MNIST under data.root (torchvision's raw IDX files)."""

    source: ClassVar[str | None] = "mnist"
    name: str = "mnist"


@dataclass
class ImageFolderDataConfig(ImageDataConfig):
    """``data=imagefolder``: any tree data.root/train/<class>/*.png (and data.root/val held out)."""

    source: ClassVar[str | None] = "imagefolder"
    name: str = "imagefolder"
    root: str = "data"  # the folder holding train/ and val/


@dataclass
class FakeDataConfig(ImageDataConfig):
    """``data=fakedata``: torchvision's random images, for smoke runs."""

    source: ClassVar[str | None] = "fakedata"
    name: str = "fakedata"
    fake_size: int = 1024  # training images (validation: a quarter as many)


# data.name -> its schema, in the order the reference lists them
DATA_SCHEMAS: dict[str, type[DataConfig]] = {schema.source: schema for schema in (  # type: ignore[misc]
    MarkovDataConfig, TextDataConfig, TokensDataConfig, ChatDataConfig, GaussianDataConfig, Cifar10DataConfig,
    MnistDataConfig, ImageFolderDataConfig, FakeDataConfig)}


def data_schema(name: Any) -> type[DataConfig]:
    """The schema of data source `name`.

    Raises:
        ConfigError: an unknown source, naming the known ones.
    """
    try:
        return DATA_SCHEMAS[str(name)]
    except KeyError:
        raise ConfigError(f"unknown data.name={name!r}; valid: {', '.join(DATA_SCHEMAS)}") from None


def data_keys(name: Any) -> list[str]:
    """The keys data source `name` takes (``data=<name>``), in its schema's order."""
    return [spec.name for spec in fields(data_schema(name))]


def data_schema_of(node: Any) -> type[DataConfig]:
    """The schema a composed data section stands for: its own where composing typed it
    (``data=<name>``'s), else (the common base, a plain YAML's) the one its ``name`` names."""
    if isinstance(node, DataConfig):
        return type(node)
    own = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
    if isinstance(own, type) and issubclass(own, DataConfig) and own.source is not None:
        return own
    name = OmegaConf.select(node, "name") if OmegaConf.is_config(node) else (node or {}).get("name")
    return data_schema(DataConfig.name if name is None else name)


def typed_data(node: Any) -> DataConfig:
    """A composed data section (or a whole config's ``data``, resolved) as its source's typed
    object, checked once by its ``__post_init__``; an object already typed as it is.

    Raises:
        ConfigError: an unknown source, a value of the wrong kind, or a name another schema's.
    """
    if isinstance(node, DataConfig):
        return node
    schema = data_schema_of(node)
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=True) if OmegaConf.is_config(node) else node
    unknown = [key for key in values if key not in {spec.name for spec in fields(schema)}]
    if unknown:  # a plain YAML's: composing refuses them in overrides and group files
        raise ConfigError(f"data.{unknown[0]} is not a key of data={schema.source}; its keys: "
                          f"{', '.join(data_keys(schema.source))}")
    return OmegaConf.to_object(OmegaConf.merge(schema_node(schema), values))


@functools.lru_cache(maxsize=None)
def schema_node(schema: type) -> DictConfig:
    """The typed config of `schema`'s defaults, made once per schema (a tenth of a config check's
    time): ``OmegaConf.merge`` copies its first argument, so merging onto it leaves it as made."""
    return OmegaConf.structured(schema)


def check_data_links(cfg: Any) -> None:
    """Every ``${data.<key>}`` the model's config reads (``model.num_classes: ${data.num_classes}``)
    names a key the chosen data source has: ``model=resnet18`` on ``data=markov`` is named here,
    not as an interpolation error while the model is built.

    Raises:
        ConfigError: naming the model key, the source, and the sources that have the key.
    """
    model, data = OmegaConf.select(cfg, "model", throw_on_missing=False), OmegaConf.select(cfg, "data")
    if not OmegaConf.is_dict(model) or data is None:
        return
    keys = {spec.name for spec in fields(data_schema_of(data))}
    source = OmegaConf.select(data, "name")
    for path, value in _leaves(OmegaConf.to_container(model, resolve=False), "model"):
        match = re.fullmatch(r"\$\{data\.(\w+)\}", value) if isinstance(value, str) else None
        if match and match.group(1) not in keys:
            key = match.group(1)
            having = [name for name, schema in DATA_SCHEMAS.items() if key in {s.name for s in fields(schema)}]
            if key == "vocab_size" and "tokenizer" in keys:  # data=chat: the vocabulary is its tokenizer's
                raise ConfigError(f"{path}={value} but data={source} has no vocabulary of its own: its token ids are "
                                  f"its tokenizer's (data.tokenizer, or model.path), which model=hf reads; use "
                                  f"model=hf model.path=<the Hugging Face folder>, or set {path}=<the tokenizer's "
                                  f"size>")
            raise ConfigError(f"{path}={value} but data={source} has no {key}: choose data that has it "
                              f"(data={', '.join(having)}), or set {path}=<value>")


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf under `node` (a container)."""
    if isinstance(node, dict):
        return [leaf for key, child in node.items() for leaf in _leaves(child, f"{prefix}.{key}")]
    return [(prefix, node)]
