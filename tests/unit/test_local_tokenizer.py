"""--tokenizer: a text request's prompt token ids as vLLM computes them, from a tokenizer
built here whose ids are the sim's (``tests.sim_tokenizer``): exact ids for completions
and chats, the special-token rules, and None for whatever is not reproduced exactly."""

from __future__ import annotations

import asyncio
import json

import pytest

from engines.sim import model
from pdproxy.config.scheduling import SchedulingConfig, parse_tokenizers
from pdproxy.errors import ConfigError
from pdproxy.proxying.prompt_tokens import PromptTokens
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.wire.local_tokenizer import LocalTokenizer
from tests.sim_tokenizer import write_model_dir

# The sim's own chat format (engines.sim.model.render_chat), as a chat template.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that loops over content parts (vLLM's "openai" content format).
PARTS = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}:"
    "{% for part in m['content'] %}[{{ part.text }}]{% endfor %}\n{% endfor %}"
)
TEXT = "The quick brown fox, jumps over the lazy dog! twice?"
WORDS = [TEXT, CHATML, PARTS, "system user assistant developer Hi there again s", "a b x y"]


def load(tmp_path, *, bos=False, template=CHATML, **config) -> LocalTokenizer:
    folder = write_model_dir(
        tmp_path / "m", WORDS, bos=bos, config={"chat_template": template, **config}
    )
    return LocalTokenizer.load(str(folder))


def chat(*messages: tuple[str, str], **fields) -> dict:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **fields}


def test_a_completion_prompt_is_the_sims_tokens(tmp_path):
    tok = load(tmp_path)
    assert tok.prompt_ids({"prompt": TEXT}) == model.tokenize(TEXT)
    assert tok.prompt_ids({"prompt": [TEXT]}) == model.tokenize(TEXT)  # a list of one
    assert tok.prompt_ids({"prompt": TEXT}, threaded=True) == model.tokenize(TEXT)


def test_the_bos_of_the_post_processor_is_added_unless_special_tokens_are_off(tmp_path):
    tok = load(tmp_path, bos=True)
    assert tok.prompt_ids({"prompt": TEXT}) == [1, *model.tokenize(TEXT)]
    assert tok.prompt_ids({"prompt": TEXT, "add_special_tokens": False}) == model.tokenize(TEXT)
    assert tok.prompt_ids({"prompt": TEXT, "add_special_tokens": "false"}) == model.tokenize(TEXT)


@pytest.mark.parametrize(
    ("bos_in_file", "config", "first"),
    [
        (True, {"add_bos_token": False, "bos_token": "<s>"}, []),  # the config turns it off
        (False, {"add_bos_token": True, "bos_token": "<s>"}, [1]),  # ... or on
        (False, {"add_bos_token": True, "bos_token": {"content": "<s>"}}, [1]),  # AddedToken
        (False, {"add_bos_token": True}, []),  # no BOS token named: none to add
    ],
)
def test_add_bos_token_in_the_config_rebuilds_the_post_processor_as_transformers_does(
    tmp_path, bos_in_file, config, first
):
    tok = load(tmp_path, bos=bos_in_file, **config)
    assert tok.prompt_ids({"prompt": TEXT}) == [*first, *model.tokenize(TEXT)]


def test_a_chat_is_rendered_by_its_template_then_encoded_without_special_tokens(tmp_path):
    tok = load(tmp_path, bos=True)  # a BOS post-processor: not applied to chats
    messages = [{"role": "system", "content": "a b"}, {"role": "user", "content": TEXT}]
    body = {"model": "m", "messages": messages}
    assert tok.prompt_ids(body) == model.tokenize(model.render_chat(messages))
    closed = {**body, "add_generation_prompt": False}
    assert tok.prompt_ids(closed) == model.tokenize(
        model.render_chat(messages, generation_prompt=False)
    )
    with_bos = {**body, "add_special_tokens": True}
    assert tok.prompt_ids(with_bos) == [1, *model.tokenize(model.render_chat(messages))]


def test_message_shapes_follow_vllms_content_formats(tmp_path):
    string_format = load(tmp_path)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "x"}],
    }
    # "string" format: text parts joined with a newline; developer is system here
    expected = model.render_chat(
        [{"role": "system", "content": "y"}, {"role": "user", "content": "a b\nx"}]
    )
    body = {"messages": [{"role": "developer", "content": "y"}, parts]}
    assert string_format.prompt_ids(body) == model.tokenize(expected)
    # "openai" format: a text content becomes one text part; the template's bos_token
    openai_format = load(tmp_path, bos=True, template=PARTS, bos_token="<s>")
    ids = openai_format.prompt_ids({"messages": [{"role": "user", "content": "Hi"}, parts]})
    assert ids == [1, *model.tokenize("user:[Hi]\nuser:[a b][x]\n")]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a b", "x y"]},  # a batch: several requests to vLLM
        {"prompt": TEXT, "truncate_prompt_tokens": 4},
        {"prompt": TEXT, "add_special_tokens": "maybe"},  # vLLM answers 400
        {"prompt": ""},
        chat(("user", "Hi"), tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(("user", "Hi"), continue_final_message=True, add_generation_prompt=False),
        chat(("user", "Hi"), chat_template="{{ messages }}"),
        chat(("user", "Hi"), chat_template_kwargs={"messages": []}),
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": []},
    ],
)
def test_what_cannot_be_reproduced_exactly_has_no_ids(tmp_path, body):
    assert load(tmp_path).prompt_ids(body) is None


def test_a_template_that_raises_or_does_not_compile_leaves_chats_without_ids(tmp_path, caplog):
    raising = load(tmp_path, template="{{ raise_exception('no system role') }}")
    assert raising.prompt_ids(chat(("user", "Hi"))) is None
    broken = load(tmp_path, template="{% for m in messages %}")  # never ends
    assert not broken.has_chat_template and "does not compile" in caplog.text
    assert broken.prompt_ids(chat(("user", "Hi"))) is None
    assert broken.prompt_ids({"prompt": TEXT}) == model.tokenize(TEXT)  # completions still


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = load(tmp_path, template="{% if extra %}x {% endif %}{{ messages[0].content }}")
    assert tok.prompt_ids(chat(("user", "a"), chat_template_kwargs={"extra": True})) == (
        model.tokenize("x a")
    )
    assert tok.prompt_ids(chat(("user", "a"))) == model.tokenize("a")


def test_the_files_chat_template_jinja_wins_and_named_templates(tmp_path):
    folder = write_model_dir(tmp_path / "m", WORDS, config={"chat_template": "y"})
    (folder / "chat_template.jinja").write_text("x {{ messages[0].content }}")
    assert LocalTokenizer.load(str(folder)).prompt_ids(chat(("user", "a"))) == model.tokenize("x a")
    named = [{"name": "tool_use", "template": "y"}, {"name": "default", "template": "b"}]
    other = write_model_dir(tmp_path / "n", WORDS, config={"chat_template": named})
    by_file = LocalTokenizer.load(str(other / "tokenizer.json"))  # the file itself
    assert by_file.prompt_ids(chat(("user", "a"))) == model.tokenize("b")


def test_files_that_cannot_be_loaded_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load"):
        LocalTokenizer.load(str(tmp_path / "missing"))
    folder = write_model_dir(tmp_path / "m", WORDS)
    (folder / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not an object"):
        LocalTokenizer.load(str(folder))
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot load"):
        LocalTokenizer.load(str(folder))


def test_tokenizer_specs():
    assert parse_tokenizers(("/models/a", "chat=/m/b", "./x=y")) == (
        ("", "/models/a"),
        ("chat", "/m/b"),
        ("", "./x=y"),
    )
    for bad in ("=/m", "chat="):
        with pytest.raises(ConfigError):
            parse_tokenizers((bad,))
    with pytest.raises(ConfigError, match="one tokenizer per model"):
        SchedulingConfig(tokenizers=(("", "/a"), ("", "/b")))


async def test_prompt_tokens_fill_only_what_kv_events_reads(tmp_path):
    tok = load(tmp_path)
    other = LocalTokenizer.load(str(write_model_dir(tmp_path / "o", WORDS, bos=True, config={})))
    wanted = {"m", "o"}
    filler = PromptTokens({"": tok, "o": other}, lambda m: m in wanted, inline_chars=10)
    try:
        body = {"model": "m", "prompt": TEXT}  # longer than 10 characters: on a thread
        filled = await filler.fill(body, RequestFeatures(model="m"))
        assert filled.token_ids == model.tokenize(TEXT)
        own = await filler.fill({**body, "model": "o"}, RequestFeatures(model="o"))
        assert own.token_ids == [1, *model.tokenize(TEXT)]  # the model's own tokenizer
        unscored = RequestFeatures(model="z")  # its policies do not read token ids
        assert await filler.fill({**body, "model": "z"}, unscored) is unscored
        given = RequestFeatures(model="m", token_ids=[5])  # token-in, --render-once
        assert await filler.fill(body, given) is given
        short = await filler.fill({"prompt": "a b"}, RequestFeatures(model="m"))  # inline
        assert short.token_ids == model.tokenize("a b")
        batch = RequestFeatures(model="m")
        assert await filler.fill({"prompt": ["a", "b"]}, batch) is batch
        both = await asyncio.gather(
            *(filler.fill(body, RequestFeatures(model="m")) for _ in range(4))
        )
        assert {tuple(f.token_ids or ()) for f in both} == {tuple(model.tokenize(TEXT))}
    finally:
        filler.close()


async def test_each_text_request_outcome_is_counted(tmp_path):
    """pdproxy_prompt_tokens_total's outcomes: exact, unsupported, failed, no_tokenizer;
    requests kv-events does not score, or that carry their ids, are not counted."""
    from collections import Counter

    from pdproxy.observability.metrics import PROMPT_TOKEN_OUTCOMES

    counted: Counter[str] = Counter()

    class Broken:
        name = "broken"

        def prompt_ids(self, body, threaded=False):
            raise RuntimeError("the tokenizer's own bug")

    filler = PromptTokens(
        {"m": load(tmp_path), "b": Broken()},  # type: ignore[dict-item]
        lambda m: m != "z",
        count=lambda outcome: counted.update([outcome]),
    )
    try:
        for model_name, body, outcome in (
            ("m", {"prompt": TEXT}, "exact"),
            ("m", {"prompt": ["a", "b"]}, "unsupported"),  # a batch
            ("b", {"prompt": TEXT}, "failed"),  # the tokenizer raised: the request goes on
            ("n", {"prompt": TEXT}, "no_tokenizer"),
            ("z", {"prompt": TEXT}, None),  # not scored by kv-events: not counted
        ):
            before = counted.copy()
            features = RequestFeatures(model=model_name)
            filled = await filler.fill({"model": model_name, **body}, features)
            assert (filled.token_ids is not None) == (outcome == "exact")
            assert counted - before == (Counter([outcome]) if outcome else Counter())
        given = RequestFeatures(model="m", token_ids=[5])
        assert await filler.fill({"model": "m", "prompt": TEXT}, given) is given
    finally:
        filler.close()
    assert dict(counted) == {"exact": 1, "unsupported": 1, "failed": 1, "no_tokenizer": 1}
    assert set(counted) == set(PROMPT_TOKEN_OUTCOMES)


def test_the_flag_reaches_the_config():
    from pdproxy.cli.main import parse_config

    config = parse_config(
        ["--prefill", "h:1", "--decode", "h:2", "--tokenizer", "/m/a", "chat=/m/b"], environ={}
    )
    assert config.scheduling.tokenizers == (("", "/m/a"), ("chat", "/m/b"))
    assert json.dumps(config.scheduling.tokenizers)


def test_the_tokenizer_is_loaded_only_for_kv_events(tmp_path, caplog):
    import random

    from prometheus_client import CollectorRegistry

    from pdproxy.build import build_state
    from pdproxy.config.proxy import ProxyConfig
    from pdproxy.proxying.steps import PromptTokensStep
    from pdproxy.types import EngineAddress

    def state(policy: str, path: str):
        scheduling = SchedulingConfig(prefill_policy=policy, tokenizers=(("", path),))
        config = ProxyConfig(
            prefill=(EngineAddress(url="http://127.0.0.1:9"),),
            decode=(EngineAddress(url="http://127.0.0.1:10"),),
            scheduling=scheduling,
        )
        return build_state(config, lambda: 0.0, CollectorRegistry(), random.Random(0))

    missing = str(tmp_path / "missing")
    ignored = state("prefix-affinity", missing)  # never read: no policy reads token ids
    assert ignored.orchestrator.steps == () and "is ignored" in caplog.text
    with pytest.raises(ConfigError, match="cannot load"):
        state("kv-events", missing)
    folder = write_model_dir(tmp_path / "m", WORDS)
    [step] = state("kv-events", str(folder)).orchestrator.steps
    assert isinstance(step, PromptTokensStep) and step.tokens.tokenizer_for("any") is not None
