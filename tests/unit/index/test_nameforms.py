"""Names kept by their form (``kvfs.index.nameforms``): every name comes back whole
and distinct, through lookups, renames, links, listings, the checkpoint image and
the journal's replay, and a pool whose names were stored whole (an image of a
release before forms) keeps every name reachable once forms are learned."""

from __future__ import annotations

import random

import pytest

from kvfs.common.errors import Corruption, Exists, NotFound
from kvfs.format import nsimage
from kvfs.format.nsparts import FORM_HEAD
from kvfs.format.records import decode_ops
from kvfs.index.nameforms import NameForms
from kvfs.index.namespace import Namespace
from kvfs.testing.harness import lmcache_name
from tests.unit.index.test_namespace import DIR, FILE, Logged, R, assert_same, replayed


def _names(rng: random.Random, n: int) -> list[bytes]:
    """Engine-like names and others: LMCache's (signed hex of any length), hex
    digests in a frame, odd digit counts and leading zeros, runs too short to pay,
    upper-case hex, arbitrary bytes, names at the 255-byte limit."""
    out: set[bytes] = set()
    while len(out) < n:
        k = rng.randrange(9)
        if k == 0:
            out.add(lmcache_name(rng.getrandbits(40)))
        elif k == 1:
            out.add(b"model@1@0@%x@bfloat16.pt" % rng.randrange(-(1 << 63), 1 << 63))
        elif k == 2:
            digits = rng.randrange(1, 80)
            run = b"".join(
                rng.choice(b"0123456789abcdef").to_bytes(1, "big") for _ in range(digits)
            )
            out.add(b"kv_" + run + rng.choice([b".bin", b"", b"-0.pt"]))
        elif k == 3:
            out.add(b"%0*x" % (rng.randrange(1, 64), rng.getrandbits(200)))
        elif k == 4:
            out.add(b"chunk-%08d.pt" % rng.randrange(10**8))
        elif k == 5:
            out.add(b"%X" % rng.getrandbits(128))
        elif k == 6:
            raw = bytes(
                rng.choice([c for c in range(1, 256) if c != 0x2F])
                for _ in range(rng.randrange(1, 60))
            )
            if raw not in (b".", b".."):
                out.add(raw)
        elif k == 7:
            out.add(b"p" * rng.randrange(0, 100) + b"%x" % rng.getrandbits(600))
        else:
            out.add(b"%x-%d.pt" % (rng.getrandbits(64), rng.randrange(10**6)))
    names = sorted({name[:255] for name in out})  # not the set's order: it varies by run
    rng.shuffle(names)
    return names


@pytest.mark.parametrize("seed", range(4))
def test_an_entry_gives_back_its_name_and_no_other(seed: int) -> None:
    rng = random.Random(seed)
    forms = NameForms()
    names = _names(rng, 4000)
    seen: dict[bytes, bytes] = {}
    packed = 0
    for _ in range(2):  # the second time round, every shared form is interned
        for name in names:
            entry = forms.entry(name)
            assert forms.name(entry) == name
            assert forms.entry(name, intern=False) == entry or entry == name
            assert seen.setdefault(entry, name) == name, "two names, one entry"
            if entry[:1] == b"\0":
                packed += 1
                assert len(entry) < len(name)
                assert (len(entry) + 3) // 4 < (len(name) + 3) // 4
            else:
                assert entry == name
    assert packed > len(names) // 4


def test_a_form_is_interned_at_its_second_name_only() -> None:
    forms = NameForms()
    first, second = (
        b"meta-llama-Meta-Llama-3-8B@1@0@%x@bfloat16.pt" % h for h in (0x1F2E, 0x7A3B4C5D6E7F8091)
    )
    assert forms.entry(first) == first and len(forms) == 0
    entry = forms.entry(second)
    assert len(forms) == 1 and entry[:1] == b"\0" and len(entry) <= FORM_HEAD.size + 8
    assert forms.entry(b"a-nonexistent-%x@bfloat16.pt" % 5, intern=False).startswith(b"a-")
    # names that share nothing but their digits never fill the table
    for i in range(3000):
        forms.entry(b"%016x-%d.pt" % (random.getrandbits(64), i))
    assert len(forms) == 1


def _model_check(ns: Namespace, d: int, model: dict[bytes, int]) -> None:
    assert dict(ns.directory(d).items()) == model
    for name, ino in model.items():
        assert ns.lookup(d, name).ino == ino


@pytest.mark.parametrize("seed", range(3))
def test_names_by_form_through_every_namespace_path(seed: int) -> None:
    """Create, look up, rename (across forms and to whole names), hard-link, remove;
    then the image, the journal, and the image plus the journal's tail, each loaded
    into a fresh namespace, give the same tree."""
    rng = random.Random(seed)
    lg = Logged()
    ns = lg.ns
    d = ns.make(R, b"d", DIR, 0, 0).ino
    e = ns.make(R, b"e", DIR, 0, 0).ino
    names = _names(rng, 3000)
    model: dict[int, dict[bytes, int]] = {d: {}, e: {}}
    for name in names[:2000]:
        model[d][name] = ns.make(d, name, FILE, 0, 0).ino
    assert len(ns._forms) > 0
    image = list(ns.snapshot_payloads())
    mark = len(lg.txns)
    spare = names[2000:]
    for step in range(3000):
        k = rng.randrange(5)
        where = rng.choice([d, e])
        if not model[where]:
            continue
        name = rng.choice(list(model[where]))
        if k == 0:
            inode = ns.remove(where, name, want_dir=False)
            if inode.nlink == 0:  # its last name
                ns.drop(inode)
            del inode
            del model[where][name]
        elif k == 1 and spare:
            new = spare.pop()
            to = rng.choice([d, e])
            ns.rename(where, name, to, new)
            model[to][new] = model[where].pop(name)
        elif k == 2 and spare:
            new = spare.pop()
            ns.link(model[where][name], e, new)
            model[e][new] = model[where][name]
        elif k == 3:
            with pytest.raises(Exists):
                ns.make(where, name, FILE, 0, 0)
        else:
            other = d if where == e else e
            if name not in model[other]:
                with pytest.raises(NotFound):
                    ns.lookup(other, name)
        if step % 500 == 0:
            _model_check(ns, d, model[d])
    for parent, entries in model.items():
        _model_check(ns, parent, entries)
    assert_same(ns, replayed(lg.txns))
    for loaded in (image, list(ns.snapshot_payloads())):
        fresh = Namespace(lambda ops: None)
        for payload in loaded:
            fresh.load_payload(payload)
        if loaded is image:
            for raw in lg.txns[mark:]:
                for op in decode_ops(raw):
                    fresh.apply(op)
        fresh.finish_load()
        assert_same(ns, fresh)
        for parent, entries in model.items():
            _model_check(fresh, parent, entries)


def test_whole_names_of_an_older_image_stay_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A version 3 image keeps every name whole (as an earlier release wrote it).
    Loaded by this release, which then learns the same names' form from new files,
    each old name is still found, refused as a duplicate, renamed and removed."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    d = ns.make(R, b"d", DIR, 0, 0).ino
    with monkeypatch.context() as m:
        m.setattr(NameForms, "entry", lambda self, name, intern=True: name)
        old = {lmcache_name(i): ns.make(d, lmcache_name(i), FILE, 0, 0).ino for i in range(300)}
    assert len(ns._forms) == 0
    image = list(ns.snapshot_payloads())
    fields = list(nsimage._META.unpack_from(image[0], 8))
    # no form in use: written as version 3, which an earlier release reads too
    assert image[0][1] == nsimage.K_META and fields[0] == 3
    fresh = Namespace(lambda ops: None)
    for payload in image:
        fresh.load_payload(payload)
    fresh.finish_load()
    new = {lmcache_name(i): fresh.make(d, lmcache_name(i), FILE, 0, 0).ino for i in range(300, 600)}
    assert len(fresh._forms) == 2  # the new names are kept by their form (two signs)
    assert sum(fresh._name_len[i] for i in new.values()) < 16 * len(new)
    _model_check(fresh, d, {**old, **new})
    for name in old:
        with pytest.raises(Exists):
            fresh.make(d, name, FILE, 0, 0)
    names = list(old)
    for i, name in enumerate(names[:100]):
        fresh.rename(d, name, d, lmcache_name(1000 + i))
        old[lmcache_name(1000 + i)] = old.pop(name)
    for name in names[100:200]:
        fresh.drop(fresh.remove(d, name, want_dir=False))
        del old[name]
        with pytest.raises(NotFound):
            fresh.lookup(d, name)
    _model_check(fresh, d, {**old, **new})
    again = Namespace(lambda ops: None)
    for payload in fresh.snapshot_payloads():
        again.load_payload(payload)
    again.finish_load()
    assert_same(fresh, again)
    _model_check(again, d, {**old, **new})


def test_an_image_from_a_newer_release_is_refused() -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    image = list(ns.snapshot_payloads())
    fields = list(nsimage._META.unpack_from(image[0], 8))
    fields[0] = nsimage.VERSION + 1
    image[0] = image[0][:8] + nsimage._META.pack(*fields) + image[0][8 + nsimage._META.size :]
    fresh = Namespace(lambda ops: None)
    with pytest.raises(Exception, match="namespace image version 5"):
        for payload in image:
            fresh.load_payload(payload)


def test_a_name_whose_make_interns_its_form_is_found_by_the_same_object() -> None:
    """The make that interns a name's form (its second name) stores it by form, and
    a lookup of the same name object right after finds it. (A full directory makes
    the lookups probe other rows.)"""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for i in range(4000):
        ns.make(R, b"f-%d" % i, FILE, 0, 0)
    for j in range(300):
        ns.make(R, b"kv%d-%032x.bin" % (j, 1), FILE, 0, 0)  # the form is seen once
        name = b"kv%d-%032x.bin" % (j, 2)
        with pytest.raises(NotFound):
            ns.lookup(R, name)
        ino = ns.make(R, name, FILE, 0, 0).ino
        assert len(ns._forms) == j + 1 and ns._name_len[ino] < len(name)
        assert ns.lookup(R, name).ino == ino
        with pytest.raises(Exists):
            ns.make(R, name, FILE, 0, 0)


def _counts_by_form(ns: Namespace) -> dict[int, int]:
    """The entries by form in the arena, counted row by row (rows dropped and not
    yet reclaimed included: their names go when they are)."""
    out: dict[int, int] = {}
    for ino in range(ns.next_ino):
        n = ns._name_len[ino]
        head = ns._arena.get(ns._name_off[ino], min(n, FORM_HEAD.size)) if n else b""
        if head[:1] == b"\0":
            fid = FORM_HEAD.unpack_from(head)[1]
            out[fid] = out.get(fid, 0) + 1
    return out


def _assert_forms_consistent(ns: Namespace) -> None:
    forms = ns._forms
    counted = _counts_by_form(ns)
    assert {fid: forms.counts[fid] for fid in forms.ids.values()} == counted
    assert sorted(forms.free) == [i for i, p in enumerate(forms.parts) if p is None]
    assert all(forms.ids[p] == i for i, p in enumerate(forms.parts) if p is not None)


def test_a_form_goes_with_its_last_name() -> None:
    """Frames that come and go (a request id in every name, two files each) leave no
    form behind, and the image none: the forms in use are what names use."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    d = ns.make(R, b"d", DIR, 0, 0).ino
    names = [
        b"%064x_%032x" % (random.getrandbits(256), request)
        for request in range(2000)
        for _ in range(2)
    ]
    for name in names:
        ns.make(d, name, FILE, 0, 0)
    assert len(ns._forms) == 2000  # the second name of each request's frame
    _assert_forms_consistent(ns)
    full = sum(map(len, ns.snapshot_payloads()))
    for name in names:
        ns.drop(ns.remove(d, name, want_dir=False))
    _assert_forms_consistent(ns)
    image = list(ns.snapshot_payloads())  # (dropped rows are reclaimed first)
    assert len(ns._forms) == 0 and len(ns._forms.free) == 2000
    _assert_forms_consistent(ns)
    assert sum(map(len, image)) < full / 4
    assert nsimage._META.unpack_from(image[0], 8)[0] == 3  # no form in use
    # the freed ids serve new forms
    for i in range(10):
        ns.make(d, lmcache_name(i), FILE, 0, 0)
    assert 1 <= len(ns._forms) <= 2 and len(ns._forms.parts) == 2000
    _assert_forms_consistent(ns)


@pytest.mark.parametrize("seed", range(3))
def test_forms_churn_at_the_cap_with_images_along_the_way(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names of many frames made, renamed and removed with room for only 6 forms
    (and 5 remembered first sightings): forms are freed, their ids reused, names of
    a new form kept whole while the table is full. At every step the counts match
    the arena; at the end the live tree, the journal replayed, and each image taken
    on the way plus the journal after it all give the same tree."""
    monkeypatch.setattr("kvfs.index.nameforms.MAX_FORMS", 6)
    monkeypatch.setattr("kvfs.index.nameforms.MAX_SEEN", 5)
    rng = random.Random(seed)
    lg = Logged()
    ns = lg.ns
    d = ns.make(R, b"d", DIR, 0, 0).ino
    serial = iter(range(10**9))

    def new_name() -> bytes:
        frame = rng.randrange(12)
        return b"f%d@%x@bf16" % (frame, (next(serial) << 40) | rng.getrandbits(40))

    model: dict[bytes, int] = {}
    images: list[tuple[list[bytes], int]] = []
    full_seen = False
    for step in range(4000):
        k = rng.randrange(10)
        if k < 5 or not model:
            name = new_name()
            model[name] = ns.make(d, name, FILE, 0, 0).ino
        elif k < 7:
            name = rng.choice(list(model))
            ns.drop(ns.remove(d, name, want_dir=False))
            del model[name]
        elif k < 9:
            name, new = rng.choice(list(model)), new_name()
            ns.rename(d, name, d, new)
            model[new] = model.pop(name)
        else:
            name = rng.choice(list(model))
            with pytest.raises(Exists):
                ns.make(d, name, FILE, 0, 0)
        full_seen |= len(ns._forms) == 6
        if step % 400 == 0:
            _assert_forms_consistent(ns)
            _model_check(ns, d, model)
            images.append((list(ns.snapshot_payloads()), len(lg.txns)))
    assert full_seen and len(ns._forms.parts) <= 6
    _assert_forms_consistent(ns)
    _model_check(ns, d, model)
    assert_same(ns, replayed(lg.txns))
    for image, mark in images:
        fresh = Namespace(lambda ops: None)
        for payload in image:
            fresh.load_payload(payload)
        for raw in lg.txns[mark:]:
            for op in decode_ops(raw):
                fresh.apply(op)
        fresh.finish_load()
        assert_same(ns, fresh)
        _model_check(fresh, d, model)
        _assert_forms_consistent(fresh)


def test_a_name_with_a_nul_is_never_found() -> None:
    """No valid name holds a NUL byte; an entry by form starts with one. A lookup,
    removal or rename given an entry's raw bytes as a name finds nothing."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for i in range(2):
        ino = ns.make(R, b"model@1@0@%016x@bfloat16.pt" % (i + 1), FILE, 0, 0).ino
    raw = ns._arena.get(ns._name_off[ino], ns._name_len[ino])
    assert raw[:1] == b"\0"
    with pytest.raises(NotFound):
        ns.lookup(R, raw)
    with pytest.raises(NotFound):
        ns.remove(R, raw, want_dir=False)
    with pytest.raises(NotFound):
        ns.rename(R, raw, R, b"x")
    assert ns.lookup(R, b"model@1@0@%016x@bfloat16.pt" % 2).ino == ino


def test_an_image_without_its_forms_does_not_give_wrong_names() -> None:
    """An entry by form whose form the image lacks (a damaged image): the name
    cannot be read back (EIO), and is never read as another name."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for i in range(3):
        ns.make(R, b"model@1@0@%016x@bfloat16.pt" % (i + 1), FILE, 0, 0)
    image = [
        p
        for p in ns.snapshot_payloads()
        if not (p[1] == nsimage.K_SIDE and p[2] == nsimage.S_FORMS)
    ]
    fresh = Namespace(lambda ops: None)
    for payload in image:
        fresh.load_payload(payload)
    fresh.finish_load()
    with pytest.raises(Corruption, match="form 0, which is not in use"):
        fresh.directory(R).items()
    with pytest.raises(Corruption):  # EIO, not another file
        fresh.lookup(R, b"model@1@0@%016x@bfloat16.pt" % 2)
