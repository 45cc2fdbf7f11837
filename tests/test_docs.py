"""The documentation: links that resolve, and two front pages that agree.

(a) Every relative link and image in README.md, README.zh-CN.md,
    ARCHITECTURE.md and docs/*.md points to a file that exists, and every
    `#anchor` into a markdown file matches one of its headings (GitHub's slug
    rules: lower case, punctuation dropped, spaces to hyphens, repeats get
    -1, -2...).
(b) README.md and README.zh-CN.md show the same shell commands (lines of
    ```sh blocks, comments aside), the same other code blocks, the same HTTP
    routes and the same config keys.

Pure text checks: no service, no TensorFlow.
"""
import glob
import os
import re

import pytest
import yaml

from tests.helpers import ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target); text may hold one level of [brackets]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files(root=ROOT):
    names = ["README.md", "README.zh-CN.md", "ARCHITECTURE.md"]
    files = [os.path.join(root, n) for n in names]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return files


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def prose_lines(text):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def code_blocks(text):
    """[(language, [lines])] of every fenced code block, in order."""
    blocks, cur, lang = [], None, None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if m and cur is None:
            lang, cur = line.strip()[3:].strip().split(" ")[0], []
        elif m:
            blocks.append((lang, cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


def slug(heading):
    """GitHub's anchor for a heading's text (github-slugger)."""
    s = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    s = re.sub(r"<[^>]+>", "", s)                           # inline HTML tags
    s = s.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)                          # keeps letters, digits, _, -, space
    return s.replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    for line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text):
    """Every link target in the prose (inline code spans excluded)."""
    for line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for rx in (LINK, HTML_LINK):
            for m in rx.finditer(line):
                yield m.group(1)
        m = REF_DEF.match(line)
        if m:
            yield m.group(1)


def broken_links(path):
    """['file: target (why)'] for each link in `path` that does not resolve."""
    text = read(path)
    base = os.path.dirname(path)
    bad = []
    for target in links(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # external: not checked here
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(base, file_part)) if file_part else path
        if not os.path.exists(dest):
            bad.append(f"{os.path.relpath(path, ROOT)}: {target} (no such file)")
            continue
        if anchor and dest.endswith(".md"):
            if anchor.lower() not in anchors(read(dest)):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target} (no heading #{anchor})")
    return bad


# --- (a) links --------------------------------------------------------------

@pytest.mark.parametrize("path", doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_links_resolve(path):
    assert os.path.exists(path), path
    assert broken_links(path) == []


def test_docs_exist_and_front_page_is_short():
    assert len(glob.glob(os.path.join(ROOT, "docs", "*.md"))) >= 1
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().split("\n")) <= 251  # at most 250 lines (+ final newline)


def test_slug_rules():
    assert slug("Model slots: `make bench-slots` (`bench/slots.py`; `--quick`; part of `make bench`)") \
        == "model-slots-make-bench-slots-benchslotspy---quick-part-of-make-bench"
    assert slug("How `auto` chooses") == "how-auto-chooses"
    assert slug("Rollouts (`rollouts.py`, `frontend/rollout_handlers.py`)") \
        == "rollouts-rolloutspy-frontendrollout_handlerspy"
    assert slug("两条命令") == "两条命令"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_checker_catches_breakage(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Some part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#some-part) [ok](#top) [ext](https://example.com/x)\n"
        "# Top\n\n`[not a link](missing.md)`\n\n```\n[nor this](missing.md)\n```\n"
        "[gone](missing.md) ![img](nothere.png) [bad](other.md#no-such-part) [self](#nope)\n",
        encoding="utf-8")
    bad = broken_links(str(page))
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)", "nothere.png (no such file)",
        "other.md#no-such-part (no heading #no-such-part)", "#nope (no heading #nope)"]


# --- (b) the English and Chinese front pages agree ---------------------------

EN, ZH = (os.path.join(ROOT, n) for n in ("README.md", "README.zh-CN.md"))
ROUTE = re.compile(r"(?<![A-Za-z0-9_.~/-])/(?:v2\b|[a-z][a-z_]*)(?:[\w<>\[\]{}.?=&/-]*)")
HOST_PORT = re.compile(r"\b[\w.-]+:\d{2,5}(?=/)")
FILE_EXT = {"py", "md", "yaml", "yml", "json", "png", "txt", "db", "toml", "conf"}


def shell_commands(text):
    """Lines of ```sh blocks, comment lines and trailing comments dropped."""
    out = []
    for lang, lines in code_blocks(text):
        if lang not in ("sh", "bash", "shell", "console"):
            continue
        for line in lines:
            line = re.sub(r"\s+#\s.*$", "", line).rstrip()
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line)
    return out


def other_code_blocks(text):
    return [(lang, lines) for lang, lines in code_blocks(text)
            if lang not in ("sh", "bash", "shell", "console")]


def routes(text):
    text = HOST_PORT.sub(" ", text)
    return {m.group(0).rstrip(".,;:)") for m in ROUTE.finditer(text)}


def config_keys(text):
    with open(os.path.join(ROOT, "config.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    sections = [k for k, v in config.items() if isinstance(v, dict)]
    scalars = [k for k, v in config.items() if not isinstance(v, dict)]
    rx = re.compile(r"(?<![\w./-])(%s)\.([a-z_][a-z0-9_]*)\b" % "|".join(map(re.escape, sections)))
    keys = {f"{s}.{k}" for s, k in rx.findall(text) if k not in FILE_EXT}
    keys |= {k for k in scalars if re.search(r"(?<![\w-])%s\b" % re.escape(k), text)}
    return keys


def test_front_pages_link_each_other():
    assert "(README.zh-CN.md)" in "\n".join(read(EN).split("\n")[:5])
    assert "(README.md)" in "\n".join(read(ZH).split("\n")[:5])


def test_same_shell_commands():
    en, zh = shell_commands(read(EN)), shell_commands(read(ZH))
    assert any(c.startswith("make serve") for c in en) and any(c.startswith("make test") for c in en)
    assert en == zh


def test_same_other_code_blocks():
    assert other_code_blocks(read(EN)) == other_code_blocks(read(ZH))


def test_same_routes():
    en, zh = routes(read(EN)), routes(read(ZH))
    assert {"/predict", "/train", "/apply"} <= en
    assert any(r.startswith("/v2/") for r in en)
    assert sorted(en - zh) == [] and sorted(zh - en) == []


def test_same_config_keys():
    en, zh = config_keys(read(EN)), config_keys(read(ZH))
    assert en, "no config key found in README.md"
    assert sorted(en - zh) == [] and sorted(zh - en) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_config_keys_exist(path):
    """A `section.key` the docs mention is a key of config.yaml."""
    with open(os.path.join(ROOT, "config.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    missing = sorted(k for k in config_keys(read(path))
                     if "." in k and k.split(".", 1)[1] not in config[k.split(".", 1)[0]])
    assert missing == []


def test_sync_checks_can_fail():
    en = read(EN)
    assert routes(en + "\nPOST `/frobnicate`\n") != routes(en)
    assert config_keys(en + "\n`worker.some_key`\n") != config_keys(en)
    assert shell_commands(en + "\n```sh\nmake frob\n```\n") != shell_commands(en)
