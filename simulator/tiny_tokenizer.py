"""A small model directory with a real BPE tokenizer and Jinja chat templates, built offline.

Nothing here may download a model, yet the precise index's hardest case is a real one: a
byte-level BPE tokenizer that adds BOS to text prompts, and a chat template that writes its
own special tokens, as Llama 3's and Qwen's do. ``build`` trains such a tokenizer on a
fixed corpus (deterministic, well under a second) and writes what ``wire.tokenizer``,
transformers and SGLang read: ``tokenizer.json`` and ``tokenizer_config.json`` (tokens,
``tokenizer_class``, the chat template). The simulator takes the directory as
``--tokenizer``, the gateway too, so both sides tokenize as an engine with that model would.

    python -m simulator.tiny_tokenizer /tmp/tiny-model [--template llama3|chatml|parts]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<unk>"]

# Llama 3's shape: BOS written by the template, one header per message, content trimmed.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# ChatML with tools and a thinking switch, as Qwen's templates have them.
CHATML = """{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] != 'system' %}
<|im_start|>{{ message['role'] }}
{% if message.tool_calls is defined %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}"""

# A template that loops over content parts (SGLang passes it lists, not strings).
PARTS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}[{{ part['type'] }}]{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "parts": PARTS}


def _corpus() -> list[str]:
    words = ("the a of to and in is it you that he was for on are with as I his they be at one have this from or "
             "had by word but what some we can out other were all there when up use your how said an each she "
             "which do their time if will way about many then them write would like so these her long make thing "
             "see him two has look more day could go come did number sound no most people my over know water than "
             "call first who may down side been now find any new work part take get place made live where after "
             "back little only round man year came show every good me give our under name very through just form "
             "sentence great think say help low line differ turn cause much mean before move right boy old too same "
             "tell does set three want air well also play small end put home read hand port large spell add even "
             "land here must big high such follow act why ask men change went light kind off need house picture "
             "try us again animal point mother world near build self earth father head stand own page should "
             "country found answer school grow study still learn plant cover food sun four between state keep eye "
             "never last let thought city tree cross farm hard start might story saw far sea draw left late run "
             "question tool function system user assistant").split()
    lines = []
    for i in range(400):
        chunk = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(chunk) + f" {i} {{\"k\": {i}}}.\n")
    return lines


def build(out: str | Path, template: str = "llama3", vocab_size: int = 2000) -> Path:
    """Write the directory and return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "unk_token": "<unk>", "model_max_length": 131072, "chat_template": TEMPLATES[template]}
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--template", choices=sorted(TEMPLATES), default="llama3")
    args = p.parse_args()
    print(build(args.out, args.template))


if __name__ == "__main__":
    main()
