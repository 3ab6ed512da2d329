"""Tool-call parsing/formatting, chat-template rendering, the calculator and argument checks."""

from __future__ import annotations

import pytest

from hybridflow.agent.loop.tool_calls import (
    ToolCall,
    format_tool_call,
    parse_tool_calls,
    render_messages,
    template_renders_tool_role,
    template_renders_tools,
)
from hybridflow.agent.loop.tools import TOOLS, Tool, ToolResult, run_tool
from hybridflow.agent.loop.tools.calculator import CalculatorError, evaluate
from tests.agent_helpers import QWEN2_STYLE_TEMPLATE

STRICT = (
    "{%- for m in messages %}{%- if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role') }}{%- endif %}[{{ m.role }}]{{ m.content }}{%- endfor %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from hybridflow.models import load_tokenizer, tiny_model_dir

    return load_tokenizer(tiny_model_dir("llama"))  # SmolLM2-135M-Instruct's tokenizer and template


class _Tok:
    """Just enough of a tokenizer to render a chat template with transformers' jinja environment."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False, tools=None, add_generation_prompt=False):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
        )
        return rendered[0]


def test_parse_well_formed_calls_and_content():
    text = f'Let me compute.\n{format_tool_call("calculator", {"expression": "12 * 34"})}\n<tool_call>{{"name": "python", "arguments": "{{\\"code\\": \\"print(1)\\"}}"}}</tool_call>'
    turn = parse_tool_calls(text)
    assert turn.calls == [ToolCall("calculator", {"expression": "12 * 34"}), ToolCall("python", {"code": "print(1)"})]
    assert turn.content == "Let me compute." and not turn.errors and turn.has_calls


@pytest.mark.parametrize(
    "body, problem",
    [
        ("{not json}", "invalid JSON"),
        ('["calculator"]', 'string "name"'),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "1 +"}', "not JSON"),
    ],
)
def test_malformed_calls_become_errors_not_exceptions(body, problem):
    turn = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert not turn.calls and len(turn.errors) == 1 and problem in turn.errors[0] and turn.has_calls


def test_unclosed_call_and_plain_answer():
    turn = parse_tool_calls('The answer is 5 <tool_call>{"name": "calculator"')
    assert turn.content == "The answer is 5" and "without a closing" in turn.errors[0]
    plain = parse_tool_calls("The answer is 408.")
    assert not plain.has_calls and plain.content == "The answer is 408."


def test_template_probes_and_fallbacks():
    schema = TOOLS.get("calculator").schema
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "c"},
        {"role": "tool", "content": "7"},
    ]
    qwen = _Tok(QWEN2_STYLE_TEMPLATE)
    assert template_renders_tools(qwen) and template_renders_tool_role(qwen)
    out, kwargs = render_messages(qwen, messages, [schema])
    assert out == messages and kwargs == {"tools": [schema]}
    strict = _Tok(STRICT)
    assert not template_renders_tools(strict) and not template_renders_tool_role(strict)
    out, kwargs = render_messages(strict, messages, [schema])
    assert kwargs == {} and out[0]["role"] == "system" and '"calculator"' in out[0]["content"]
    assert out[-1] == {"role": "user", "content": "<tool_response>\n7\n</tool_response>"}
    merged, _ = render_messages(strict, [{"role": "system", "content": "Be brief."}] + messages, [schema])
    assert merged[0]["content"].startswith("Be brief.\n\n") and len(merged) == 4


def test_smollm2_template_ignores_tools_but_renders_the_tool_role(smollm2_tokenizer):
    assert not template_renders_tools(smollm2_tokenizer) and template_renders_tool_role(smollm2_tokenizer)


@pytest.mark.parametrize(
    "expression, value",
    [("123 * 456", 56088), ("-(2 + 3) ** 2", -25), ("7 / 2", 3.5), ("7 // 2 % 3", 0), ("2 ** 10", 1024)],
)
def test_calculator_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "x + 1", "2 ** 1000", "9" * 60 + " * " + "9" * 60, "1 / 0", "[1] * 3", "1 +"]
)
def test_calculator_refuses(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_calculator_tool_results():
    calc = TOOLS.get("calculator")()
    assert run_tool(calc, {"expression": "6 / 3"}) == ToolResult("2")
    assert run_tool(calc, {"expression": "1 / 0"}).ok is False
    missing = run_tool(calc, {})
    assert not missing.ok and "missing argument" in missing.text
    assert "must be of type string" in run_tool(calc, {"expression": 5}).text
    assert "unknown argument" in run_tool(calc, {"expression": "1", "x": 1}).text


def test_a_raising_tool_costs_only_its_call():
    class Broken(Tool):
        schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object"}}}

        def call(self, arguments):
            raise RuntimeError("boom")

    result = run_tool(Broken(), {})
    assert not result.ok and "RuntimeError: boom" in result.text


def test_tools_system_prompt_lists_every_tool_and_a_call_that_parses():
    from hybridflow.agent.loop.tool_calls import tools_system_prompt

    schemas = [TOOLS.get("calculator").schema, TOOLS.get("python").schema]
    prompt = tools_system_prompt(schemas)
    assert "- calculator(expression: string): Evaluate" in prompt
    assert "- python(code: string): Run" in prompt
    parsed = parse_tool_calls(prompt)
    assert parsed.calls == [ToolCall("calculator", {"expression": "..."})] and not parsed.errors
