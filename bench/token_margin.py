"""How chatmem counts a model it has no tokenizer for, against what a small model's tokenizer
needs: the non-Latin margin of ``conversations.chat_model.tokens`` (UNKNOWN_MODEL_NON_LATIN_MARGIN).

For each sample text (English, Russian, Chinese, Thai, and a mix): cl100k's and o200k's counts,
chatmem's count for an unknown model name, and what SmolLM2-135M's tokenizer needs by the per-script
ratios measured with its own vocabulary on llama.cpp's server (1.52 Cyrillic, 1.59 Chinese, 1.99
Thai, per cl100k token). With ``--tokenizer path/to/tokenizer.json`` (a model's own, read offline
with the ``tokenizers`` package), or ``--tokenize-url`` (a llama.cpp server's ``/extras/tokenize``,
which counts with the GGUF's own vocabulary), the real counts are added. Plain Python, no Django.

    python -m bench.token_margin [--tokenizer tokenizer.json | --tokenize-url URL] [--margin 2.2]
                                 [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from collections.abc import Callable

from conversations.chat_model import tokens

SAMPLES = {
    "english": (
        "My locker code is 4821 and I keep my swimming gear there. Next month I fly to Lisbon "
        "for a conference; book a quiet hotel near the venue, at most 150 euros a night."
    ),
    "russian": (
        "Мой код от шкафчика 4821, там лежат мои вещи для бассейна. В следующем месяце я лечу "  # noqa: RUF001
        "в Лиссабон на конференцию; забронируй тихий отель рядом, не дороже 150 евро за ночь."
    ),
    "chinese": (
        "我的储物柜密码是4821，游泳用品放在里面。下个月我要飞去里斯本参加会议，"  # noqa: RUF001
        "请在会场附近订一家安静的酒店，每晚不超过150欧元。"  # noqa: RUF001
    ),
    "thai": (
        "รหัสล็อกเกอร์ของฉันคือ 4821 ฉันเก็บชุดว่ายน้ำไว้ในนั้น เดือนหน้าฉันจะบินไปลิสบอน"
        "เพื่อร่วมประชุม ช่วยจองโรงแรมเงียบๆ ใกล้สถานที่จัดงาน ไม่เกินคืนละ 150 ยูโร"
    ),
}
SAMPLES["mixed"] = " ".join(SAMPLES.values())
# SmolLM2-135M's tokens per cl100k token, by script (docs/benchmarks.md).
SMOLLM2_RATIOS = (
    ("\u0400", "\u04ff", 1.52),
    ("\u4e00", "\u9fff", 1.59),
    ("\u0e00", "\u0e7f", 1.99),
)


def cl100k(text: str) -> int:
    return tokens.count_tokens(text, "gpt-4")


def smollm2_estimate(text: str) -> int:
    total = float(cl100k(text))
    for run in tokens.NON_LATIN.findall(text):
        ratios = [r for low, high, r in SMOLLM2_RATIOS if any(low <= c <= high for c in run)]
        total += (max(ratios, default=1.0) - 1.0) * cl100k(run)
    return math.ceil(total)


def file_counter(path: str) -> Callable[[str], int]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def server_counter(url: str) -> Callable[[str], int]:
    def count(text: str) -> int:
        body = json.dumps({"input": text, "add_special": False}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return len(json.load(answer)["tokens"])

    return count


def micros(count: Callable[[str], int], text: str, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        count(text)
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a model's tokenizer.json, counted for real")
    parser.add_argument(
        "--tokenize-url", help="e.g. http://127.0.0.1:8089/extras/tokenize (llama.cpp's server)"
    )
    parser.add_argument("--margin", type=float, default=tokens.DEFAULT_NON_LATIN_MARGIN)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    tokens.read_settings_with(lambda: ("", 1.0, args.margin))
    real = file_counter(args.tokenizer) if args.tokenizer else None
    if args.tokenize_url:
        real = server_counter(args.tokenize_url)

    def unknown(text: str) -> int:
        return tokens.count_tokens(text, "local-model")

    header = "text      cl100k  o200k  chatmem(unknown)  smollm2(est.)  headroom"
    print(header + ("  real (headroom)" if real else "") + "  µs cl100k / unknown")
    for name, text in SAMPLES.items():
        base, estimate, counted = cl100k(text), smollm2_estimate(text), unknown(text)
        row = (
            f"{name:9} {base:6} {tokens.count_tokens(text, 'gpt-4o'):6} "
            f"{counted:8} ({counted / base:.2f}x) {estimate:7} ({estimate / base:.2f}x) "
            f"{counted / estimate - 1:+8.0%}"
        )
        if real is not None:
            row += f"  {real(text):6} ({real(text) / base:.2f}x)"
        timing = (
            f"  {micros(cl100k, text, args.repeat):.1f} / {micros(unknown, text, args.repeat):.1f}"
        )
        if real is not None:
            row += f" headroom {counted / real(text) - 1:+.0%}"
        print(row + timing)


if __name__ == "__main__":
    main()
