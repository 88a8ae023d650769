"""Which model files a command runs: -m/-md, or -hf/-hfd resolved through the hub, or the
embedded pair."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specli.cli.console import err, spinner
from specli.errors import UsageError


def resolve_models(model: str | None, model_draft: str | None, hf: str | None,
                   hf_file: str | None, hf_draft: str | None, hf_file_draft: str | None,
                   token: str | None, quiet: bool = False,
                   spec_types: Sequence[str] = ()) -> tuple[str, str | None]:
    """-m/-md, or -hf/-hff and -hfd/-hffd resolved through the hub (llama.cpp's spellings);
    with neither, the embedded SmolLM2 pair. -hfd without -hffd takes the draft-head sidecar
    the repository ships, as llama.cpp does: the one a head type in spec_types names, or
    with no draft type asked for, the first it ships (MTP, DSpark, DFlash, Eagle3)."""
    progress = not quiet and err.is_terminal
    if hf is not None or hf_file is not None:
        from specli import hub  # -m alone never imports the hub

        if model is not None:
            raise UsageError("give -m or -hf, not both")
        if hf is None:
            raise UsageError("-hff/--hf-file needs -hf REPO")
        model = str(hub.fetch(hub.parse_ref(hf), hf_file, token=token, progress=progress)[0])
    if hf_draft is not None or hf_file_draft is not None:
        if model_draft is not None:
            raise UsageError("give -md or -hfd, not both")
        if hf_draft is None:
            raise UsageError("-hffd/--hf-file-draft needs -hfd REPO")
        from specli import hub

        ref = hub.parse_ref(hf_draft)
        heads = [t for t in hub.SIDECARS if t in spec_types] or (
            [] if "draft-simple" in spec_types else list(hub.SIDECARS))
        found = (hub.fetch_sidecars(ref, heads, token=token, progress=progress)
                 if heads and hf_file_draft is None else {})
        listing = hub.checkpoint_listing(ref, None, token) if (
            not found and heads and hf_file_draft is None) else None
        if listing is not None:
            if model is None:
                raise UsageError(f"-hfd {ref.repo} is a safetensors head checkpoint: give the "
                                 "target to convert it against with -m or -hf")
            model_draft = head_from_hub(ref, model, token, [t for t in heads if t in
                                                            spec_types], quiet,
                                        listing=listing)[0]
        else:
            model_draft = str(next(iter(found.values()), None) or
                              hub.fetch(ref, hf_file_draft, token=token, progress=progress)[0])
    if model is None:
        if model_draft is not None:
            raise UsageError("-md/--model-draft needs -m/--model", hint="give the target with -m")
        from specli.defaults import default_pair

        with spinner("preparing the embedded SmolLM2 pair", quiet):
            model, model_draft = default_pair()
    return model, model_draft


def _bar(quiet: bool):
    """A transient progress bar on stderr (a terminal only), or None."""
    if quiet or not err.is_terminal:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    console=err, transient=True)


def head_from_hub(ref, target: str, token: str | None, kinds=(), quiet: bool = False,
                  revision: str | None = None, listing=None) -> tuple[str, str]:
    """A repository's safetensors head checkpoint (-hfd, `download --eagle3`), fetched and
    converted against the target GGUF, or found converted in the cache: (its path, its
    head type). kinds: the head types asked for (empty: any); listing: the repository's
    files, when the caller has listed them."""
    from specli import hub
    from specli.headconvert import cached_head, plan_head
    from specli.headmeta import A_HEAD

    progress = not quiet and err.is_terminal
    snapshot, commit, within = hub.fetch_checkpoint(ref, revision, token, progress,
                                                    listing=listing)
    _, plan, _ = plan_head(snapshot, target, within)  # checked before any hashing
    if kinds and plan.spec_type not in kinds:
        raise UsageError(f"{ref.repo} is {A_HEAD[plan.spec_type]} ({plan.spec_type}), not "
                         f"{' or '.join(kinds)}", hint="ask for its type, or another repository")
    bar = _bar(quiet)
    if bar is None:
        path, fresh = cached_head(snapshot, within, ref.repo, commit, target)
    else:
        with bar:
            hashing = bar.add_task(f"sha256 {Path(target).name}", total=None)
            task = bar.add_task(f"converting {ref.repo}", total=None)
            path, fresh = cached_head(
                snapshot, within, ref.repo, commit, target,
                progress=lambda d, t, _n: bar.update(task, completed=d, total=t),
                hashing=lambda d, t: bar.update(hashing, completed=d, total=t))
    if fresh and not quiet:
        err.print(f"converted {ref.repo}@{commit[:12]} against {Path(target).name}: {path}",
                  markup=False)
    return str(path), plan.spec_type
