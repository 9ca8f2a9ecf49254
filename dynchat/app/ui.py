"""The Gradio app: chat, live metrics against the baseline, plots, session table and CSV.

Knows nothing of KV caches: it renders the TurnUpdates ChatService yields. Model work goes
through one shared concurrency group ("model", DYNCHAT_CONCURRENT_CHATS at once, 1 on ZeroGPU);
GPU work is wrapped by `spaces.GPU` on ZeroGPU.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import uuid
from pathlib import Path

import gradio as gr
import pandas as pd

from ..engine.policies import DEFAULT_POLICY, POLICIES
from .chat import ChatService
from .engines import ZERO_GPU
from .metrics import TABLE_COLUMNS
from .state import MAX_CHATS_KEPT, LRUDict
from .store import Store, write_csv
from .turns import MAX_NEW_TOKENS_LIMIT, Settings, TurnError

try:  # ZeroGPU: a no-op unless SPACES_ZERO_GPU=true; the app runs without the package
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:  # pragma: no cover - depends on the host
    def gpu(fn):
        return fn

CSV_DIR = Path(tempfile.gettempdir()) / "dynchat-csv"
CONCURRENT_CHATS = 1 if ZERO_GPU else int(os.environ.get("DYNCHAT_CONCURRENT_CHATS", "8"))
COLORS = {"draft": "#bbf7d0", "target": "#e5e7eb"}
MODES_INFO = ("baseline: plain decoding; lookup: drafts copied from this chat and the model's earlier replies (no "
              "draft model); assistant: a small draft model; eagle3: a head reading the target's features")
SESSION_OUTPUTS = 6         # what App.session_outputs returns, in the order build() lists the components


# Category labels "1", "2", ... in numeric order: without it the plots sort them as text ("1", "10",
# "11", ..., "2"), seen on the per-position bars of a 16-token lookahead.
IN_ORDER = [str(i) for i in range(1, 1001)]

def text_block(text: str) -> list[dict]:
    """Message content as a text block: Gradio runs inspect.cleandoc on plain-string messages,
    which strips indentation (code) and made a streamed reply shrink as lines arrived."""
    return [{"type": "text", "text": text}]


def uses_lookahead_policy(preset) -> bool:
    """vLLM drafts a fixed number of tokens per server: the policy control would do nothing there."""
    return preset.engine != "vllm"


def _fmt(v, spec=".1f", none="–"):
    return none if v is None else format(v, spec)


MEASURING_BASELINE = "*measuring the plain baseline on the same prompt ...*"
BASELINE_STOPPED = "*stopped before the baseline finished: no speedup figure for this reply*"


def metrics_markdown(m: dict, status: str = "", notice: str = "") -> str:
    if not m:
        return "*Send a message to see live metrics.*"
    lines = [
        f"**tokens/s** {_fmt(m.get('tokens_per_s'))} &nbsp; **acceptance rate** {_fmt(m.get('acceptance_rate'), '.2f')} "
        f"&nbsp; **mean accepted length** {_fmt(m.get('mean_accepted_length'), '.2f')} &nbsp; "
        f"**lookahead** {m.get('lookahead', '–')}"
        + (" *(acceptance from the server's counters, shared with other requests)*" if m.get("acceptance_shared") else ""),
        f"**new tokens** {m.get('new_tokens', 0)} &nbsp; **time to first token** {_fmt((m.get('ttft_s') or 0) * 1000, '.0f')} ms"
        + (f" &nbsp; **weights** {m['weights']}" if m.get("weights") else ""),
    ]
    if m.get("baseline_tokens_per_s") is not None:
        why = slower_because(m)
        same = m.get("same_tokens_as_baseline")          # None when sampling: nothing to check
        check = ("" if same is None else " &nbsp; *same tokens as the baseline*" if same
                 else f" &nbsp; *the baseline parts from the reply at token {m['baseline_parts_at'] + 1}*")
        lines.append(f"**baseline** {_fmt(m['baseline_tokens_per_s'])} tokens/s &nbsp; "
                     f"**speedup** {_fmt(m.get('speedup'), '.2f')}x" + (f" ({why})" if why else "") + check)
    elif status == "baseline":
        lines.append(MEASURING_BASELINE)
    if status == "queued":
        lines.append("*waiting: this preset's engine serves one chat at a time and another chat is generating*")
    if (m.get("chats_now") or 0) > 1:
        lines.append(f"**chats at once** {m['chats_now']} &nbsp; **all chats** {_fmt(m.get('all_chats_tokens_per_s'))} tokens/s"
                     " *(they share the engine: per-reply figures are under load)*")
    if status in ("cancelled", "error"):
        lines.append(f"**{status}**" + (f": {notice}" if notice else ""))
    elif notice:
        lines.append(f"*{notice}*")
    return "  \n".join(lines)


BASELINE_TITLE = "plain decoding of the same prompt (the baseline)"


def baseline_message(update, done: bool) -> list[dict]:
    """Plain decoding's reply to the same prompt, streamed as a collapsible thought under the reply: the
    page renders it as it rendered the reply, so both are timed under the same load (a browser on the
    same machine takes CPU while text streams), and a reader sees what the speedup was measured
    against. Thoughts are not conversation (turns.history_messages leaves them out)."""
    if not update.baseline_reply and update.status != "baseline":
        return []
    m = update.metrics
    meta = {"title": BASELINE_TITLE, "status": "done" if done else "pending"}
    if done:
        figure = m.get("baseline_tokens_per_s")
        meta["log"] = f"{figure:.1f} tokens/s" if figure is not None else "stopped"
    return [{"role": "assistant", "content": text_block(update.baseline_reply), "metadata": meta}]


def settle_thoughts(history: list) -> list:
    """A baseline the page last saw running (its turn was stopped before the final update) is shown as
    stopped, not spinning forever."""
    out = []
    for m in history:
        meta = m.get("metadata") if isinstance(m, dict) else None
        if meta and meta.get("title") == BASELINE_TITLE and meta.get("status") == "pending":
            m = {**m, "metadata": {**meta, "status": "done", "log": "stopped"}}
        out.append(m)
    return out


def after_stop(shown: str) -> str:
    """The metrics line once Stop was pressed: a cancelled turn's last update never reaches the page, so
    a line saying the baseline is being measured would stay there until the next message."""
    return (shown or "").replace(MEASURING_BASELINE, BASELINE_STOPPED)


def slower_because(m: dict) -> str:
    """A few words on why a reply ran slower than plain decoding, so a 0.8x does not read as a bug."""
    speedup = m.get("speedup")
    if speedup is None or speedup >= 1.0 or m.get("acceptance_rate") is None:
        return ""
    if (m.get("new_tokens") or 0) < 24:
        return "short reply: reading the prompt dominates and drafting has little to speed up"
    if m["acceptance_rate"] < 0.4:
        return "low acceptance: the target rejected most drafted tokens"
    return "drafting and verifying cost more than the accepted tokens saved on this reply"


def plots(turns: pd.DataFrame, last_rounds: list[dict], per_position: list[float]):
    # turns as labels: a numeric axis puts ticks between turns ("1, 2, 2" for two turns); the plots
    # order the labels as numbers (IN_ORDER), so turn 10 follows turn 9
    turns = turns.assign(turn=[str(i) for i in range(1, len(turns) + 1)])
    ok = turns[turns["status"] == "ok"]
    speed = pd.concat([
        pd.DataFrame({"turn": ok["turn"], "tokens_per_s": ok["tokens_per_s"], "series": "method"}),
        pd.DataFrame({"turn": ok["turn"], "tokens_per_s": ok["baseline_tokens_per_s"], "series": "baseline"}),
    ]).dropna()
    acc = ok.dropna(subset=["acceptance_rate"])
    acc = pd.DataFrame({"turn": acc["turn"], "acceptance_rate": acc["acceptance_rate"], "series": "acceptance"})
    pos = pd.DataFrame({"position": [str(i + 1) for i in range(len(per_position))], "acceptance": per_position})
    rounds = pd.DataFrame(last_rounds[1:] or [{"drafted": 0, "accepted": 0}])
    look = pd.concat([pd.DataFrame({"round": range(1, len(rounds) + 1), "tokens": rounds["drafted"], "series": "drafted"}),
                      pd.DataFrame({"round": range(1, len(rounds) + 1), "tokens": rounds["accepted"], "series": "accepted"})])
    return (speed if len(speed) else None, acc if len(acc) else None, pos if len(pos) else None, look)


class App:
    def __init__(self, service: ChatService):
        self.service = service
        # per client: its newest CSV file (an evicted client's file is deleted with it)
        self._csv_files = LRUDict(MAX_CHATS_KEPT, on_evict=lambda path: Path(path).unlink(missing_ok=True))

    # -- handlers ----------------------------------------------------------------------------
    def init_client(self, client_id):
        return client_id or uuid.uuid4().hex

    def on_preset(self, name, current, progress=gr.Progress()):
        """Load a preset's models (cached); on failure keep the current one and say why."""
        try:
            progress(0.1, desc=f"loading preset {name} (models are cached after the first load)")
            engine = self.service.engine(name)
            progress(1.0, desc="ready")
        except Exception as e:  # noqa: BLE001 - shown to the user, the app keeps serving
            gr.Warning(f"preset {name!r} is unavailable: {e}")
            return current, gr.skip(), current, gr.skip(), gr.skip(), gr.skip()
        modes = engine.modes
        return (name, gr.update(choices=modes, value=engine.preset.default_mode(modes)), name, engine.preset.description,
                gr.Dataset(samples=[[e] for e in engine.preset.examples or ["Hello!"]], label=f"examples ({name})"),
                gr.update(visible=uses_lookahead_policy(engine.preset)))

    def session_outputs(self, client_id, rounds=(), per_position=()):
        """Values for the SESSION_OUTPUTS components: four plots, the turns table, the CSV file."""
        turns = self.service.store.session_turns(client_id, with_text=True)
        CSV_DIR.mkdir(parents=True, exist_ok=True)
        # a fresh unguessable name per file: Gradio serves it to whoever holds the URL
        path = write_csv(turns, CSV_DIR / f"dynchat-turns-{uuid.uuid4().hex}.csv")
        old = self._csv_files.get(client_id)
        if old:
            Path(old).unlink(missing_ok=True)
        self._csv_files[client_id] = str(path)
        return (*plots(turns, list(rounds), list(per_position)), turns[TABLE_COLUMNS].round(3), str(path))

    def respond(self, message, history, client_id, preset, mode, policy, max_new, temperature, top_p, compare):
        client_id = client_id or uuid.uuid4().hex
        history = settle_thoughts(list(history or []))
        try:
            settings = Settings(preset=preset, mode=mode, policy=policy, max_new_tokens=int(max_new),
                                temperature=float(temperature), top_p=float(top_p), compare=bool(compare))
            turn = self.service.turn(client_id, history, message, settings)
            update = next(turn)
        except (TurnError, TypeError, ValueError) as e:
            raise gr.Error(str(e), print_exception=False) from None
        chat = history + [{"role": "user", "content": text_block(message)}, {"role": "assistant", "content": ""}]
        if update.notice:
            gr.Info(update.notice)
        skip = (gr.skip(),) * SESSION_OUTPUTS
        while True:
            done = update.status in ("ok", "cancelled", "error")
            chat[len(history) + 1:] = [{"role": "assistant", "content": text_block(update.reply)},
                                       *baseline_message(update, done)]
            md = metrics_markdown(update.metrics, update.status, update.notice)
            hl = [(t, label) for t, label in update.segments]
            if done:
                yield chat, "", md, hl, *self.session_outputs(client_id, update.rounds,
                                                              update.metrics.get("per_position_acceptance", [])), client_id
                return
            yield chat, "", md, hl, *skip, client_id
            try:
                update = next(turn)
            except StopIteration:
                return

    def regenerate(self, history, client_id, preset, mode, policy, max_new, temperature, top_p, compare):
        history = list(history or [])
        while history and history[-1].get("role") == "assistant":
            history.pop()
        if not history:
            raise gr.Error("nothing to regenerate yet", print_exception=False)
        last = history.pop()
        content = last.get("content")
        if isinstance(content, list):
            content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
        yield from self.respond(content, history, client_id, preset, mode, policy, max_new, temperature, top_p, compare)

    def stop(self, client_id):
        if client_id:
            self.service.stop(client_id)

    def analysis(self):
        return self.service.store.aggregates().round(3)

    # -- layout ------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        svc = self.service
        default = svc.default_preset
        preset0 = svc.presets[default]
        with gr.Blocks(title="dynchat - speculative decoding chat") as demo:
            client = gr.BrowserState(None, storage_key="dynchat-client-id")
            loaded = gr.State(default)
            gr.Markdown("## dynchat\nSpeculative decoding you can watch: a draft proposes, the target verifies, "
                        "and every reply is measured against plain decoding of the same target.")
            with gr.Row():
                with gr.Column(scale=3):
                    chatbot = gr.Chatbot(label="chat", height=420)
                    highlight = gr.HighlightedText(label="last reply: accepted draft tokens vs target tokens",
                                                   color_map=COLORS, combine_adjacent=True, show_legend=True,
                                                   visible=False)
                    # no max_length: the browser would cut a longer paste without a word; the turn refuses it, saying why
                    msg = gr.Textbox(placeholder="Ask something ...", show_label=False, submit_btn=False)
                    with gr.Row():
                        send = gr.Button("Send", variant="primary")
                        stop = gr.Button("Stop", variant="stop")
                        regen = gr.Button("Regenerate")
                        clear = gr.Button("Clear")
                    examples = gr.Examples(preset0.examples or ["Hello!"], inputs=msg, label=f"examples ({default})")
                with gr.Column(scale=2):
                    preset = gr.Dropdown(list(svc.presets), value=default, label="preset")
                    description = gr.Markdown(preset0.description)
                    mode = gr.Radio(preset0.modes, value=preset0.default_mode(), label="mode", info=MODES_INFO)
                    policy = gr.Dropdown(list(POLICIES), value=preset0.generation.get("lookahead", DEFAULT_POLICY),
                                         label="lookahead policy", visible=uses_lookahead_policy(preset0))
                    max_new = gr.Slider(1, MAX_NEW_TOKENS_LIMIT, value=preset0.generation.get("max_new_tokens", 96),
                                        step=1, label="max new tokens")
                    temperature = gr.Slider(0, 2, value=preset0.generation.get("temperature", 0.0), step=0.05,
                                            label="temperature (0 = greedy)")
                    top_p = gr.Slider(0.05, 1, value=preset0.generation.get("top_p", 1.0), step=0.05, label="top-p")
                    compare = gr.Checkbox(not ZERO_GPU, label="compare with baseline (runs plain decoding after each reply)",
                                          info=("off on ZeroGPU: the comparison would spend a second share of your "
                                                "GPU quota on every message" if ZERO_GPU else None))
                    show_hl = gr.Checkbox(False, label="highlight accepted draft tokens")
                    metrics = gr.Markdown(metrics_markdown({}))
            with gr.Tab("plots"):
                with gr.Row():
                    # points, not lines: one turn is one point, and a line needs two
                    speed_plot = gr.ScatterPlot(x="turn", y="tokens_per_s", color="series", title="tokens/s per turn",
                                                sort=IN_ORDER, height=260)
                    acc_plot = gr.ScatterPlot(x="turn", y="acceptance_rate", color="series",
                                              title="acceptance rate per turn", sort=IN_ORDER, y_lim=[0, 1],
                                              height=260)
                with gr.Row():
                    pos_plot = gr.BarPlot(x="position", y="acceptance", title="per-position acceptance (last reply)",
                                          y_lim=[0, 1], height=260, sort=IN_ORDER)
                    look_plot = gr.LinePlot(x="round", y="tokens", color="series",
                                            title="lookahead by round (last reply)", x_axis_format="d", height=260)
            with gr.Tab("session turns"):
                table = gr.Dataframe(label="this session's turns", interactive=False)
                download = gr.DownloadButton("Download CSV", value=None)
            with gr.Tab("analysis (all sessions)") as analysis_tab:
                agg = gr.Dataframe(label="aggregates by preset and mode (no message text)", interactive=False)
                refresh = gr.Button("Refresh")

            inputs = [msg, chatbot, client, preset, mode, policy, max_new, temperature, top_p, compare]
            # the client id goes out too: a first message sent before the page's load event finished
            # gets its id from the handler, and keeps it for the rest of the session
            session = [speed_plot, acc_plot, pos_plot, look_plot, table, download]
            assert len(session) == SESSION_OUTPUTS
            outputs = [chatbot, msg, metrics, highlight, *session, client]
            # chats at once: engines that batch (vLLM) serve them together; an in-process engine takes
            # them in turn (ChatService waits on its lock and says so)
            kw = dict(concurrency_id="model", concurrency_limit=CONCURRENT_CHATS)
            # one reply at a time per page: the inputs are disabled while a reply streams (a message
            # sent meanwhile would be answered against the history as it was, and the streaming reply
            # would vanish from the chat). The API endpoints are the reply handlers themselves.
            controls = [msg, send, regen]

            def busy(trigger):
                return trigger(lambda: [gr.update(interactive=False)] * 3, None, controls, queue=False,
                               api_visibility="private")

            e1 = busy(msg.submit).then(gpu(self.respond), inputs, outputs, api_name="chat", **kw)
            e2 = busy(send.click).then(gpu(self.respond), inputs, outputs, api_name="send", **kw)
            e3 = busy(regen.click).then(gpu(self.regenerate), inputs[1:], outputs, api_name="regenerate", **kw)
            stop.click(self.stop, [client], None, cancels=[e1, e2, e3], queue=False, api_name="stop")
            stop.click(after_stop, metrics, metrics, queue=False, api_visibility="private")
            # after a reply, a refused message (gr.Error: Gradio's frontend runs no .then after a failed
            # event, and the page stayed disabled) or a Stop, the inputs take messages again
            for trigger in (e1.then, e2.then, e3.then, e1.failure, e2.failure, e3.failure, stop.click):
                trigger(lambda: [gr.update(interactive=True)] * 3, None, controls, queue=False,
                        api_visibility="private")
            clear.click(lambda: ([], None, metrics_markdown({})), None, [chatbot, highlight, metrics], queue=False,
                        api_visibility="private")
            show_hl.change(lambda v: gr.update(visible=v), show_hl, highlight, queue=False, api_visibility="private")
            preset.change(self.on_preset, [preset, loaded], [loaded, mode, preset, description, examples.dataset, policy],
                          api_name="load_preset", **kw)
            refresh.click(self.analysis, None, agg, queue=False, api_name="analysis")
            analysis_tab.select(self.analysis, None, agg, queue=False, api_visibility="private")
            for event in (e1, e2, e3):     # a logged turn changes the aggregates
                event.then(self.analysis, None, agg, queue=False, api_visibility="private")
            demo.load(self.init_client, client, client, queue=False, api_visibility="private")
            demo.load(self.analysis, None, agg, queue=False, api_visibility="private")
        return demo


def create_app(store: Store | None = None, models_path=None, preload: bool = True,
               engine_process: bool | None = None) -> gr.Blocks:
    service = ChatService(store or Store(), models_path, engine_process)
    if preload:     # load and warm the default preset now, so the first reply is measured warm
        try:
            service.engine(service.default_preset)
        except Exception as e:  # noqa: BLE001 - the app still serves; choosing the preset again says why
            print(f"warning: default preset {service.default_preset!r} did not load: {e}")
    demo = App(service).build()
    demo.queue(max_size=int(os.environ.get("DYNCHAT_QUEUE_SIZE", "16")), default_concurrency_limit=1)
    demo.service = service
    return demo


def launch(demo: gr.Blocks, **kwargs):
    """launch() with the settings a public Space needs; kwargs override (tests pass a port).

    Blocking (as `python app.py` runs it), it returns on Ctrl-C or SIGTERM (sigterm_interrupts)
    after stopping what the app started: engine worker processes and vLLM servers.
    """
    opts = dict(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), enable_monitoring=False,
                max_file_size="1mb", show_error=True, theme=gr.themes.Soft())
    opts.update(kwargs)
    if opts.get("prevent_thread_lock"):
        return demo.launch(**opts)
    try:
        return demo.launch(**opts)
    except KeyboardInterrupt:        # before Gradio's own wait took over the signal
        demo.close()
    finally:
        demo.service.close()


def sigterm_interrupts() -> None:
    """SIGTERM (a Space restarting, `kill`) ends the app as Ctrl-C does, so the same cleanup runs."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():     # signal handlers live in the main thread
        signal.signal(signal.SIGTERM, interrupt)
