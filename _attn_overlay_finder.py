"""attn-overlay's import finder, loaded when ``transformers`` is first searched for. PYTEST_DONT_REWRITE
(pytest marks a plugin distribution's top-level modules for rewriting).

``attn_overlay.pth`` imports ``_attn_overlay_startup`` at interpreter start, a few lines that put a
waiting finder on ``sys.meta_path``; the first search for ``transformers`` (or the first caller that
asks for the finder) loads this module, which puts one :class:`PostImportFinder` on ``sys.meta_path``
in its place, with a single post-import hook, on ``transformers``, that hands over to the engine
(``overlay.engine``); the engine then registers hooks on the modules its patches target, on this
same finder. Every other import passes straight through with one dictionary lookup. It imports
neither torch, transformers, packaging nor the ``overlay`` package, and never raises.

The finder runs a hook right after its module has executed: it asks the other finders for the
module's real spec and wraps that loader's ``exec_module`` (the loader object itself stays the
module's ``__loader__``, so tracebacks, ``inspect`` and ``importlib.resources`` see exactly what
they would without the overlay). Hooks may be lazy ``"module:function"`` strings, and they run
outside the finder's lock. ``importlib.reload`` goes through ``find_spec`` too, so a reloaded
target module is handed to its hooks again.

``ATTN_OVERLAY=0`` turns the startup hook off (the engine checks it again when activated).

It imports nothing that a bare ``python -c pass`` has not imported already (``sys``, ``os`` and
``_thread`` are there before ``site`` reads any ``.pth`` file): importing ``threading`` or
``functools`` here would drag in a dozen more modules into every process that imports transformers.
"""

# `_thread`, not `threading`: threading imports functools, collections, itertools, _weakrefset...
# The objects are the same ones: threading.Lock is _thread.allocate_lock, threading.local is
# _thread._local.
import _thread
import sys

# No module-level `import os` either (the functions import it; it is loaded already): the finder
# lives on sys.meta_path until the very end of the process and keeps this module's globals alive,
# and a global `os` would keep os alive with them, so that every exit would clear os's namespace
# by hand (Py_Finalize) instead of freeing it: about 1% of `python -c pass` (callgrind).

_OFF = ("0", "false", "no", "off")
_ACTIVATE = "overlay.engine:activate_from_startup"


class PostImportFinder:
    """Meta-path finder that runs hooks right after watched modules execute."""

    def __init__(self):
        self._hooks = {}  # module name -> list of callables or "module:function" strings
        self._lock = _thread.allocate_lock()
        self._searching = _thread._local()  # per thread: the names this thread is searching for
        # Modules executing through this finder now (name -> how many executions), and the names
        # it has ever run to the end: what ``watch`` tells a caller about a module it finds in
        # sys.modules, which may still be executing in another thread.
        self._executing = {}
        self._executed = set()
        # Watched packages whose spec this finder handed out and whose execution and hooks have not
        # finished (name -> spec): their hooks may watch submodules, so until then every submodule
        # imported (in any thread) is wrapped too, and looks up its hooks only once it has executed.
        self._open = {}
        # Watched packages whose execution through this finder raised before their hooks ran to
        # the end (a thread's import met transformers' own import race). The import system drops
        # such a package from sys.modules, but other threads go on importing its submodules (a
        # subpackage already imported is their parent, so the package is not imported again);
        # those stay wrapped as while it executed, until an execution of it finishes its hooks.
        self._failed_open = set()

    def watch(self, name, hook):
        """Run ``hook(module)`` each time module ``name`` executes (import or reload).

        Returns true when ``name`` is executing through this finder right now: ``hook`` then runs
        once it has executed (in the thread that executes it). False otherwise: a module of that
        name in ``sys.modules`` has then either executed to the end through this finder
        (:meth:`executed`) or was imported without it."""
        with self._lock:
            hooks = self._hooks.setdefault(name, [])
            if hook not in hooks:
                hooks.append(hook)
            return name in self._executing

    def executed(self, name):
        """Whether module ``name`` has executed to the end through this finder (its body ran)."""
        with self._lock:
            return name in self._executed and name not in self._executing

    def unwatch(self, name, hook):
        with self._lock:
            hooks = self._hooks.get(name, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                self._hooks.pop(name, None)

    def watched(self):
        with self._lock:
            return {name: tuple(hooks) for name, hooks in self._hooks.items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._hooks and not (
            (self._open or self._failed_open) and self._inside_open_package(fullname)
        ):
            return None
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:  # our own search below reached us again
            return None
        searching.add(fullname)
        try:
            spec = _find_spec_elsewhere(self, fullname, path, target)
        finally:
            searching.discard(fullname)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None
        try:
            loader.exec_module = self._wrap(loader, exec_module)
        except (AttributeError, TypeError):  # a loader without an instance dict: unhookable
            return None
        if getattr(spec, "submodule_search_locations", None) is not None and fullname in self._hooks:
            with self._lock:  # opened before the package is in sys.modules: no submodule slips by
                self._open[fullname] = spec
        return spec

    def _inside_open_package(self, fullname):
        """Whether ``fullname`` is a submodule of a package whose execution or hooks are under way
        (the package in sys.modules is the one from the spec this finder handed out), or whose
        execution failed before its hooks ran (see ``_failed_open``)."""
        for package, spec in list(self._open.items()):
            if fullname.startswith(package + ".") and getattr(sys.modules.get(package), "__spec__", None) is spec:
                return True
        return any(fullname.startswith(package + ".") for package in tuple(self._failed_open))

    def _wrap(self, loader, exec_module):
        # A closure, not functools.partial: functools is not imported at interpreter start.
        def exec_then_run_hooks(module):
            self._exec_then_run_hooks(loader, exec_module, module)

        return exec_then_run_hooks

    def _exec_then_run_hooks(self, loader, exec_module, module):
        name = module.__name__
        with self._lock:
            self._executing[name] = self._executing.get(name, 0) + 1
        hooks_ran = False
        try:
            try:
                exec_module(module)
            finally:
                # Put the loader back as it was before anything else can look at the module.
                if loader.__dict__.get("exec_module") is not exec_module:
                    loader.__dict__.pop("exec_module", None)
                # Executed (or failed) and its hooks read in one step: a hook that another thread
                # watches from now on is told the module is no longer executing, and judges it
                # itself; one watched before this point is in the list.
                with self._lock:
                    count = self._executing.pop(name) - 1
                    if count:
                        self._executing[name] = count
                    self._executed.add(name)
                    hooks = list(self._hooks.get(name, ()))
            for hook in hooks:  # outside the lock: a hook may import, and watch more modules
                if isinstance(hook, str):
                    hook = _resolve(hook)
                hook(module)
            hooks_ran = True
        finally:
            if self._open or self._failed_open:
                with self._lock:
                    opened = self._open.get(name) is getattr(module, "__spec__", None)
                    if opened:
                        del self._open[name]
                    if hooks_ran:
                        self._failed_open.discard(name)
                    elif opened:  # before the import system drops the package: no import slips by
                        self._failed_open.add(name)

    def invalidate_caches(self):
        pass


def _find_spec_elsewhere(me, fullname, path, target):
    """Ask every other meta-path finder, in order, as the import system would."""
    for finder in list(sys.meta_path):
        # The startup module's waiting finder hands "transformers" to this one: never ask it.
        if finder is me or isinstance(finder, PostImportFinder) or getattr(finder, "attn_overlay_waiting", False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _resolve(reference):
    module_name, _, attribute = reference.partition(":")
    __import__(module_name)
    return getattr(sys.modules[module_name], attribute)


def finder():
    """The finder on ``sys.meta_path`` (one per process), or ``None``."""
    for candidate in sys.meta_path:
        if type(candidate).__name__ == "PostImportFinder" and hasattr(candidate, "watch"):
            return candidate
    return None


def ensure_finder():
    """The finder, put first on ``sys.meta_path`` if it is not there yet."""
    current = finder()
    if current is None:
        current = PostImportFinder()
        for index, entry in enumerate(sys.meta_path):
            if getattr(entry, "attn_overlay_waiting", False):
                # In the startup module's place, by one item assignment: a thread walking
                # sys.meta_path meanwhile (importing something else) skips no finder.
                sys.meta_path[index] = current
                break
        else:
            sys.meta_path.insert(0, current)
    return current


def _switched_off():
    import os

    return os.environ.get("ATTN_OVERLAY", "1").strip().lower() in _OFF


def activate_when_transformers_is_imported(module=None):
    """The startup hook's one watch. Never raises: a failure is recorded by the engine."""
    if _switched_off():
        return
    try:
        shadow = shadowing_module()
        if shadow is not None:
            sys.stderr.write(shadow + "\n")
            return
        _resolve(_ACTIVATE)(module)
    except Exception as exc:  # never break `import transformers`; status says what happened
        if getattr(exc, "raise_through_import", False):
            raise  # strict mode (ATTN_OVERLAY_STRICT=1) asked for the import to fail
        try:
            _resolve("overlay.engine:record_startup_failure")(exc)
        except Exception:
            pass


def shadowing_module():
    """A one-line explanation when ``import overlay`` would not find the overlay installed next
    to this file (a user's ``overlay.py``, another distribution's ``overlay`` package), else ``None``."""
    import os

    ours = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlay", "__init__.py")
    if not os.path.exists(ours):  # a source tree without the package beside us: nothing to compare
        return None
    loaded = sys.modules.get("overlay")
    if loaded is not None:
        found = getattr(loaded, "__file__", None)
    else:
        import importlib.util

        spec = importlib.util.find_spec("overlay")
        found = getattr(spec, "origin", None)
    if found is not None and os.path.realpath(found) == os.path.realpath(ours):
        return None
    if found is not None and _is_overlay_source_tree(found):
        return None  # a clone of attn-overlay itself (working directory first on sys.path)
    return (
        f"attn-overlay: NOT active in this process: `import overlay` finds {found or 'nothing importable'}, "
        f"not attn-overlay ({ours}). Rename that file or package (or remove it from sys.path); "
        + _how_to_check()
    )


def _how_to_check():
    """Advice that works where it is given. ``python -m overlay.apply`` cannot even start in a
    folder holding the shadowing ``overlay.py`` (``-m`` finds that one first); the console script
    puts its own folder first on ``sys.path``, starts anywhere, and names the shadowing file."""
    import os

    script = os.path.join(os.path.dirname(sys.executable), "attn-overlay")
    if not os.path.isfile(script):  # no console script (pip install --target, a source tree)
        return "once it is renamed, `python -m overlay.apply` checks the result"
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, "attn-overlay") if folder else ""
        if candidate and os.path.isfile(candidate):
            if os.path.realpath(candidate) == os.path.realpath(script):
                return "`attn-overlay` checks the result (here too)"
            break  # the shell would run another environment's script
    return f"`{script}` checks the result (here too)"


def _is_overlay_source_tree(init_file):
    try:
        with open(init_file, encoding="utf-8") as handle:
            return "attn-overlay" in handle.read(4096)
    except OSError:
        return False


def install():
    """Put the finder on ``sys.meta_path`` watching ``transformers`` (``_attn_overlay_startup`` calls
    it when it hands over); idempotent, never raises."""
    try:
        if _switched_off():
            return
        ensure_finder().watch("transformers", activate_when_transformers_is_imported)
    except Exception:
        pass
