"""The app as a local user meets it: `python app.py`, chromium on the same machine, a few turns.

Prints what the page showed for each turn (tokens/s, baseline, speedup, same tokens) and how much
CPU chromium, the app and its engine worker took while the reply streamed and while the baseline
ran, sampled from /proc. A 2-core machine shares its cores between the browser and the engine, so
this is where the page's figures and the bench's can differ.

    python scripts/browser-check.py --repeats 2
    DYNCHAT_STREAM_INTERVAL=0.25 python scripts/browser-check.py
    python scripts/browser-check.py --url http://127.0.0.1:7860/      # an app you started yourself
    python scripts/browser-check.py --temperature 0.7 --top-p 0.9     # a sampled chat (no "same tokens" then)

Needs Playwright (requirements-dev.txt) and chromium (/usr/bin/chromium: tests/run.sh installs it).
The app runs from this checkout with a temporary session log; it is stopped at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TURNS = [("eagle3", "Explain what a hash table is."),
         ("eagle3", "Rewrite this sentence to sound more formal: we can't make it to the meeting tomorrow, sorry."),
         ("assistant", "How do I reverse a list in Python?"),
         ("lookup", "Give me three tips for a job interview.")]
TICKS = os.sysconf("SC_CLK_TCK")


def process_group(cmdline: str) -> str | None:
    if "chrom" in cmdline:
        return "chromium"
    if "dynchat.app.worker" in cmdline:
        return "worker"
    if "app.py" in cmdline:
        return "app"
    return None


def cpu_ticks() -> dict[str, int]:
    """utime + stime per process group, summed over its live processes."""
    out: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            group = process_group((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            if group:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                out[group] = out.get(group, 0) + int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return out


class CpuMeter:
    """Cores used per process group, per phase ("reply", "baseline"), from 0.25 s samples."""

    def __init__(self):
        self.phase: str | None = None
        self.samples: dict[str, dict[str, list[float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        last, t_last = cpu_ticks(), time.monotonic()
        while not self._stop.wait(0.25):
            now, t = cpu_ticks(), time.monotonic()
            if self.phase:
                per = self.samples.setdefault(self.phase, {})
                for group, ticks in now.items():
                    per.setdefault(group, []).append((ticks - last.get(group, ticks)) / TICKS / (t - t_last))
            last, t_last = now, t

    def take(self) -> dict[str, dict[str, float]]:
        result = {phase: {g: statistics.mean(v) for g, v in per.items()} for phase, per in self.samples.items()}
        self.samples = {}
        return result

    def close(self):
        self._stop.set()
        self._thread.join()


FIGURES = re.compile(r"tokens/s\s+([\d.]+).*?baseline\s+([\d.]+) tokens/s\s+speedup\s+([\d.]+)x", re.S)


def one_turn(page, meter: CpuMeter, mode: str, prompt: str) -> dict:
    page.get_by_role("radio", name=mode, exact=True).check()
    page.get_by_placeholder("Ask something ...").fill(prompt)
    meter.phase = "reply"
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("document.querySelector('textarea').disabled", timeout=10_000)
    deadline = time.monotonic() + 300
    while page.evaluate("document.querySelector('textarea').disabled"):
        if time.monotonic() > deadline:
            raise SystemExit(f"no reply after 300 s; the page shows:\n{page.inner_text('body')[-1500:]}")
        if meter.phase == "reply" and "measuring the plain baseline" in page.inner_text("body"):
            meter.phase = "baseline"
        time.sleep(0.1)
    meter.phase = None
    text = page.inner_text("body")
    m = FIGURES.search(text[text.find("tokens/s"):])
    cpu = meter.take()
    return {"mode": mode, "tokens_per_s": float(m[1]), "baseline": float(m[2]), "speedup": float(m[3]),
            "same_tokens": "same tokens as the baseline" in text, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="the four turns this many times, each a new chat")
    ap.add_argument("--url", help="drive an app already running there (as a newcomer started it) instead of starting one")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--pause", type=float, default=3.0,
                    help="seconds between turns, as a person types (the page renders the finished turn's plots then)")
    ap.add_argument("--screenshot", help="save the page as it looks after the last turn (PNG)")
    ap.add_argument("--temperature", type=float, help="set the page's temperature slider first (a sampled chat)")
    ap.add_argument("--top-p", type=float, help="set the page's top-p slider first")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT))
    from dynchat.bench.app import launch_app

    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "app.log", "w+") as log:
        app, url = (None, args.url) if args.url else launch_app({"DYNCHAT_DB": str(Path(tmp) / "check.db")}, log)
        meter = CpuMeter()
        rows = []
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, headless=True,
                                            args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                page.wait_for_selector("textarea")
                for label, value in (("temperature (0 = greedy)", args.temperature), ("top-p", args.top_p)):
                    if value is not None:          # the slider's number box, as a person types into it
                        box = page.get_by_role("spinbutton", name=label)
                        box.fill(str(value))
                        box.press("Enter")
                for _ in range(args.repeats):
                    page.get_by_text("Clear", exact=True).click()      # the chat's own Clear icon has the same name
                    for mode, prompt in TURNS:
                        time.sleep(args.pause)
                        row = one_turn(page, meter, mode, prompt)
                        rows.append(row)
                        cpu = "; ".join(f"{phase}: " + ", ".join(f"{g} {v:.2f}" for g, v in sorted(per.items()))
                                        for phase, per in row["cpu"].items())
                        print(f"{row['mode']:9s} {row['tokens_per_s']:6.1f} tokens/s  baseline {row['baseline']:6.1f}"
                              f"  {row['speedup']:.2f}x  same tokens {row['same_tokens']}  cores [{cpu}]", flush=True)
                if args.screenshot:
                    page.screenshot(path=args.screenshot, full_page=True)
                browser.close()
        except BaseException:
            log.seek(0)
            print("the app's last lines:\n" + "".join(log.readlines()[-40:]), file=sys.stderr)
            raise
        finally:
            meter.close()
            if app is not None:
                app.terminate()
                app.wait(60)
    by_mode: dict[str, list[float]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row["speedup"])
    print("speedup by mode (median): " + ", ".join(f"{m} {statistics.median(v):.2f}x" for m, v in by_mode.items()))


if __name__ == "__main__":
    main()
