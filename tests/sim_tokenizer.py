"""A tokenizer.json whose ids are the simulated engine's (``engines.sim.model``: one word or
one punctuation mark per token, each id a hash of its text), built with ``tokenizers`` for
the words of the texts given, so that pdproxy's ``--tokenizer`` predicts exactly what a sim
tokenizes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

from engines.sim import model

UNK = "[UNK]"
BOS = "<s>"


def sim_tokenizer_json(texts: Iterable[str], *, bos: bool = False) -> str:
    """The sim's tokenizer.json for the words of ``texts`` (others are ``[UNK]``, id 0);
    with ``bos``, a post-processor that adds ``<s>`` (id 1) as a model's BOS.

    Written as JSON around a small tokenizer's: ``tokenizers`` serializes a WordLevel
    vocabulary by walking every id up to the largest, and the sim's ids reach 2**31."""
    small = {UNK: 0, BOS: 1}
    tokenizer = Tokenizer(models.WordLevel(small, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), "isolated")]
    )
    if bos:
        tokenizer.add_special_tokens([BOS])  # "<s>" in a rendered chat is the one token
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 $B:1", special_tokens=[(BOS, 1)]
        )
    document = json.loads(tokenizer.to_str())
    vocab = {w: model.token_id(w) for text in texts for w in model.words(text)}
    document["model"]["vocab"] = {**vocab, **small}
    return json.dumps(document)


def write_model_dir(
    folder: Path,
    texts: Iterable[str],
    *,
    bos: bool = False,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """``folder`` with tokenizer.json and (when ``config``) tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(sim_tokenizer_json(texts, bos=bos))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
