"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what schedulers send before a kill) without losing steps:
`StopRequest` notes the first signal, the loop saves the step in flight and raises `Interrupted`.

  stop = StopRequest().install()              # or `with StopRequest() as stop:`
  try:
      for step in ...:
          state = train_step(state, ...)
          if stop.signal is not None:           # set by the first SIGINT / SIGTERM
              checkpointer.save(step + 1, state)
              raise Interrupted(step + 1, stop.signal, saved=True)
  finally:
      checkpointer.close()                    # a second signal during the save still exits at once
      stop.uninstall()
  stop.pass_on()                              # a signal that came during the last step, for the caller

The first signal only notes itself: the step in flight (or an XLA compile or a save, which Python cannot break into)
finishes, then the loop saves and stops; `train.py` prints `Interrupted`'s one line and exits 128 + the signal
(130 for SIGINT, 143 for SIGTERM), as a shell reports a process the signal ended. A second signal ends the process
at once, without saving: a watcher thread woken through `signal.set_wakeup_fd` (which the C-level handler writes to
even while the main thread sits in a compile) prints one line and calls `os._exit`. The previous checkpoint stays
the newest: orbax renames a checkpoint into place only once it is complete.

A signal that comes during a run's last step cannot stop it: the run completes and saves, and `pass_on` then raises
the signal again for the handlers there were before (Ctrl-C raises KeyboardInterrupt), so a caller that would start
another run stops instead.

Signal handlers belong to the main thread: elsewhere (a run started from a worker thread) `StopRequest` installs
nothing and `signal` stays None. A signal the process inherited as ignored stays ignored.
"""

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def _what(signum: int | None) -> str:
    if signum is None:
        return "stopped by stop_event"
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


class Interrupted(Exception):
    """The run stopped at `step` on signal `signum` (None: `train`'s stop_event was set); `saved`: a checkpoint of
    that step was written (False when no step had run since the start: the newest checkpoint, if any, already holds
    that step)."""

    def __init__(self, step: int, signum: int | None, saved: bool):
        self.step, self.signum, self.saved = step, signum, saved
        if saved:
            told = "checkpoint saved; re-run the same command to resume"
        else:
            told = "no step ran since the start, nothing new to save; re-run the same command to " + (
                "resume" if step else "start")
        super().__init__(f"{_what(signum)} at step {step}; {told}")

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process the signal ended; 75 (EX_TEMPFAIL) for stop_event."""
        return 75 if self.signum is None else exit_code(self.signum)


class StopRequest:
    """Context manager: while inside, SIGINT / SIGTERM set `signal` (the first one's number) instead of raising
    KeyboardInterrupt or killing the process; a second one exits at once (module docstring)."""

    def __init__(self):
        self.signal: int | None = None
        self._installed = False
        self._seen = 0  # signals the watcher has read

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> "StopRequest":
        """Installs the handlers (main thread only) and returns self."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd needs a write end that never blocks the handler
        # A signal the parent set to be ignored (a background job of a script ignores SIGINT) stays ignored.
        self._previous = {s: signal.signal(s, self._note) for s in SIGNALS
                          if signal.getsignal(s) is not signal.SIG_IGN}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="qjax-stop-request", daemon=True)
        self._watcher.start()
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Restores the handlers and wakeup fd there were before `install`."""
        if not self._installed:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._write)  # the watcher reads end-of-file and returns
        self._watcher.join(timeout=5)
        os.close(self._read)
        self._installed = False

    def pass_on(self) -> None:
        """After `uninstall`: raises the noted signal (if any) again, for the handlers restored there. Call it when
        the signal could not stop the run because no step was left to run."""
        if self.signal is not None and not self._installed:
            signal.raise_signal(self.signal)

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:  # one byte per signal: its number
                if signum not in SIGNALS:
                    continue
                self._seen += 1
                if self._seen == 1:
                    self.signal = self.signal or signum
                else:
                    _exit_now(signum)

    def _note(self, signum, frame) -> None:
        """The Python-level handler (installing it keeps SIGINT from raising KeyboardInterrupt and SIGTERM from
        killing the process). It notes a first signal too: between `uninstall` restoring the wakeup fd and restoring
        the handlers, only this handler sees one. The watcher counts the signals for the second-signal exit."""
        if self.signal is None:
            self.signal = signum


def _exit_now(signum: int) -> None:
    line = (f"{_what(signum)} again: exiting at once without saving; the newest checkpoint is kept, re-run the same "
            "command to resume from it\n")
    os.write(2, line.encode())
    os._exit(exit_code(signum))
