"""Chat templates from a hostile model file (docs/security.md, "Chat templates").

Hostile and random templates render in a child interpreter (``hardening_isolated``) under an
address-space limit, through the public ``GgufTokenizer.apply_chat_template`` of the tiny model,
so that a regression to a hang or a memory bomb fails the test (the child's timeout, the limit)
instead of hanging CI. Real-world templates must render exactly as plain Jinja2 renders them.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hardening_isolated import run_cases

pytest.importorskip("jinja2")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from pagedkv.errors import PagedKvError  # noqa: E402
from pagedkv.models import ChatTemplateError  # noqa: E402
from pagedkv.models.chat_template import render_chat_template  # noqa: E402

HERE = Path(__file__).parent

CHILD_SETUP = f"""
import os, resource, sys, tempfile
from pathlib import Path
os.environ["PAGEDKV_CACHE_DIR"] = "off"  # the tiny model must not land in the user's cache
sys.path.insert(0, {str(HERE)!r})
from tiny_gguf import write_tiny_llama
from pagedkv.models import load_model
tok = load_model(write_tiny_llama(Path(tempfile.mkdtemp()) / "t.gguf")).tokenizer
MSGS = [{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "Hi"}}]
def R(src):
    tok.chat_template = src
    return tok.apply_chat_template(MSGS)
R("{{{{ messages[0].content }}}}")  # warm up before the limit
vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
"""

# The nested-range template and the other ways a template can run away: each must be a ChatTemplateError.
HOSTILE = {
    "nested range loops (the issue's)": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "nested loops with output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"
    ),
    "string repetition": "{{ 'a' * 1000000000 }}",
    "list repetition": "{{ ([1] * 100000) * 100000 }}",
    "huge power": "{{ 9 ** (9 ** 9) }}",
    "doubling concatenation": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    ),
    "center filter": "{{ 'a'|center(1000000000) }}",
    "ljust method": "{{ 'a'.ljust(1000000000) }}",
    "percent format width": "{{ '%0999999999d' % 1 }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "replace explosion": "{% set s = 'a' * 1000000 %}{{ s.replace('', s) }}",
    "join explosion": "{% set s = 'a' * 1000000 %}{{ s.join(s) }}",
    "indent explosion": "{% set s = '\\n' * 1000000 %}{{ s|indent(1000000) }}",
    "join filter explosion": "{% set s = 'a' * 1000000 %}{{ range(100000)|join(s) }}",
    "captured block": (
        "{% set s = 'a' * 1000000 %}{% set x %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}"
    ),
    "output flood": "{% set s = 'a' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "infinite macro recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "exponential macro": (
        "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% else %}x{% endif %}{% endmacro %}{{ f(60) }}"
    ),
    "recursive loop": "{% for i in [1] recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "sort of a huge list": "{{ (range(100000)|list * 40)|sort|length }}",
    "deeply nested expression": "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}",
    "syntax error": "{% for %}",
    "undefined attribute": "{{ foo.bar.baz }}",
    "sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "mutation of the caller's list": "{{ messages.append(1) }}",
    "raise_exception": "{{ raise_exception('Conversation roles must alternate') }}",
    "lipsum": "{{ lipsum(1000000) }}",
    "shadowing a guard": "{% set __pagedkv_iter = 1 %}",
}


def test_hostile_templates_end_in_a_typed_error():
    cases = {name: f"R({src!r})" for name, src in HOSTILE.items()}
    outcomes = run_cases(CHILD_SETUP, cases, timeout_s=120)
    wrong = {name: outcomes.get(name) for name in cases if outcomes.get(name) != "ChatTemplateError"}
    assert not wrong, wrong


# Random templates: fragments that loop, grow, fail and nest, with numbers from tiny to absurd.
NUMBERS = ["0", "1", "3", "100", "100000", "1000000000", "-1"]
SEQUENCES = ["range({n})", "messages", "'abc' * {n}", "[1, 2] * {n}", "messages[0].content", "x", "ns.s"]
VALUES = [
    "x",
    "'a' * {n}",
    "x ~ x",
    "{n} ** {n}",
    "'%0{n}d' % 1",
    "'{{:>{n}}}'.format(1)",
    "({v})|center({n})",
    "({v})|indent({n})",
    "({v})|join(',')",
    "({v})|replace('', 'ab')",
    "({v})|length",
    "({v})|tojson",
    "({v})|sort",
    "({v})|list",
    "loop.index",
    "nothing.here",
    "x.__class__",
    "raise_exception('no')",
    "messages.pop()",
    "ns.s",
    "f({n})",
]


def _random_template(rng: random.Random, depth: int = 0) -> str:
    def number() -> str:
        return rng.choice(NUMBERS)

    def value(d: int = 0) -> str:
        template = rng.choice(VALUES if d < 2 else VALUES[:6])
        return template.format(n=number(), v=value(d + 1) if "{v}" in template else "")

    parts = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.35 and depth < 3:
            seq = rng.choice(SEQUENCES).format(n=number())
            parts.append(f"{{% for x in {seq} %}}{_random_template(rng, depth + 1)}{{% endfor %}}")
        elif kind < 0.55:
            parts.append(f"{{% set ns.s = ns.s ~ ({value()}) %}}")
        elif kind < 0.6:
            parts.append(rng.choice(["{% for %}", "{{ (", "{% endfor %}", "{% if %}"]))  # syntax errors
        else:
            parts.append(f"{{{{ {value()} }}}}")
    return "".join(parts)


def random_templates(count: int, seed: int = 28) -> list[str]:
    rng = random.Random(seed)
    prelude = (
        "{% set ns = namespace(s='') %}"
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    )
    return [prelude + _random_template(rng) for _ in range(count)]


def test_random_templates_render_or_fail_typed():
    templates = random_templates(150)
    cases = {f"t{i}": f"R({src!r})" for i, src in enumerate(templates)}
    outcomes = run_cases(CHILD_SETUP, cases, timeout_s=240)
    wrong = {
        templates[int(n[1:])]: outcomes.get(n)
        for n in cases
        if outcomes.get(n) not in ("OK", "ChatTemplateError")
    }
    assert not wrong, list(wrong.items())[:5]
    assert "OK" in outcomes.values() and "ChatTemplateError" in outcomes.values()  # both paths fuzzed


# Real templates (shapes of SmolLM2's, Llama 3's and Mistral's): identical output to plain Jinja2.
REAL_TEMPLATES = [
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}",
    "{%- set ns = namespace(found=false) -%}{%- for m in messages -%}{%- if m.role == 'system' -%}"
    "{%- set ns.found = true -%}{%- endif -%}{%- endfor -%}{{ ns.found }}|"
    "{{ messages|map(attribute='role')|join(',') }}|{{ messages|tojson }}|"
    "{% for m in messages %}{% if loop.last %}{% break %}{% endif %}{{ loop.index }}{% endfor %}",
]


def _plain_jinja(source: str, context: dict) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**context)


@pytest.mark.parametrize("index", range(len(REAL_TEMPLATES)))
def test_real_templates_render_as_plain_jinja(index):
    context = {
        "messages": [
            {"role": "user", "content": "Hi ünïcode"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "2 + 2?"},
        ],
        "add_generation_prompt": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    source = REAL_TEMPLATES[index]
    assert render_chat_template(source, context) == _plain_jinja(source, context)


def test_failures_are_pagedkv_errors_naming_the_cause():
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError") as caught:
        render_chat_template("{% if %}", {})
    assert isinstance(caught.value, PagedKvError)
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        render_chat_template("{{ a.b }}", {})
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat_template("{{ x.__class__.__mro__ }}", {"x": 1})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", {})


def test_budgets_apply_per_render_and_are_adjustable():
    loop = "{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}"  # 10 100 iterations
    for _ in range(3):  # one render's iterations do not count against the next
        assert render_chat_template(loop, {}, max_loop_iterations=10_100) == ""
    with pytest.raises(ChatTemplateError, match="loop-iteration budget"):
        render_chat_template(loop, {}, max_loop_iterations=10_099)
    with pytest.raises(ChatTemplateError, match="an output of 12 characters"):
        render_chat_template("{{ s }}{{ s }}", {"s": "x" * 6}, max_output_chars=10)
    with pytest.raises(ChatTemplateError, match="time budget"):
        render_chat_template(loop, {}, max_seconds=-1.0)


def test_messages_are_not_mutated_and_bools_render():
    messages = [{"role": "user", "content": "Hi"}]
    out = render_chat_template(
        "{{ messages|length }}{{ add_generation_prompt }}",
        {"messages": messages, "add_generation_prompt": True},
    )
    assert out == "1True" and messages == [{"role": "user", "content": "Hi"}]
