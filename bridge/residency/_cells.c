/* One rank's tier of per-rank tables (bridge.residency.rank_tables): three
 * layers of block hash -> copies, each an insertion-ordered map.
 *
 * Why native: the snapshot keeper holds every hash its worker's blocks have,
 * hundreds of thousands of them, and a Python dict entry with its bytes key
 * costs about 150 bytes; here an entry is 16 bytes, its key's bytes and an
 * index slot of 8 bytes (at most two thirds of the slots are in use).
 * The semantics are a Python dict's, so that a snapshot lists hashes in the
 * same order with or without this module: a key that goes and comes back
 * goes to the end; a key whose count changes keeps its place.
 *
 * A key is kept as what identifies it: a bytes hash's bytes, an int's value
 * (64 bits; a larger int as its signed little-endian bytes). Its slot in the
 * index comes from a hash keyed with a per-process random seed, so hashes
 * chosen by a peer cannot be made to collide on purpose without knowing it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>

enum { K_BYTES = 0, K_INT = 1, K_UINT = 2, K_BIG = 3 };
enum { L_TRUSTED = 0, L_SUSPECT = 1, L_PLACEHOLDER = 2 };
/* The event classes apply_run reads: a removal's and up to seven stores'. */
#define MAX_KINDS 8

/* Entries and key bytes grow by a quarter of what they hold (and a little):
 * the keeper's tables are most of its memory, and a realloc of a large
 * block costs less than the half that a faster growth leaves unused. */
#define GROW_BY 4

#define KIND_SHIFT 30
#define LEN_MASK ((1u << KIND_SHIFT) - 1)
/* An index slot: the entry's position in the low 32 bits, the top 32 bits
 * of its key's hash (its tag) above them, so that a probe skips other keys
 * without reading their entries (a cache miss each in a large table). A
 * key's first slot comes from its tag too (an index has at most 2**32
 * slots), so that a rebuild places every slot again from the slot alone:
 * entries keep no hash, and no key is read or hashed again. */
#define EMPTY UINT64_MAX
#define SLOT(fp, at) (((fp) & 0xFFFFFFFF00000000ULL) | (uint64_t)(uint32_t)(at))
#define SLOT_AT(s) ((Py_ssize_t)(uint32_t)(s))
#define SLOT_TAG_IS(s, fp) ((((s) ^ (fp)) >> 32) == 0)
#define HOME(fp, mask) ((size_t)((fp) >> 32) & (mask))

/* 16 bytes: the key's hash is not kept (its index slot holds what a probe
 * and a rebuild need of it), since the snapshot keeper holds hundreds of
 * thousands of entries. */
typedef struct {
    uint64_t key;   /* an int key's value, or a byte key's offset in the arena */
    uint32_t meta;  /* kind << KIND_SHIFT | byte length */
    uint32_t count; /* copies; 0: an entry removed (kept until compaction) */
} Entry;

typedef struct {
    Entry *e;
    Py_ssize_t n, cap; /* entries in the order they came, removed ones included */
    Py_ssize_t live;
    uint64_t *ix;      /* open addressing over `e`: EMPTY, or a SLOT */
    Py_ssize_t ixcap;  /* a power of two, or 0 */
    char *arena;       /* the keys' bytes */
    size_t alen, acap;
} OMap;

typedef struct {
    int kind;
    uint64_t v;
    const char *p;
    Py_ssize_t len;
    uint64_t fp;
    PyObject *tmp; /* owns the bytes of a large int */
} Key;

static uint64_t SEED;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    return x;
}

static uint64_t hash_bytes(const char *p, Py_ssize_t n, int kind) {
    uint64_t h = SEED ^ ((uint64_t)n * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)kind << 60);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mix(h ^ w) + 0x9E3779B97F4A7C15ULL;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    return mix(h ^ w ^ ((uint64_t)n << 56));
}

static inline uint64_t hash_int(uint64_t v, int kind) {
    return mix(SEED ^ mix(v ^ ((uint64_t)kind << 62)));
}

/* -- keys ------------------------------------------------------------------ */

/* int.to_bytes / int.from_bytes, little-endian and signed (keyword-only). */
static PyObject *signed_kwargs(void) {
    PyObject *kw = PyDict_New();
    if (kw != NULL && PyDict_SetItemString(kw, "signed", Py_True) < 0) Py_CLEAR(kw);
    return kw;
}

static PyObject *big_bytes(PyObject *o) {
    PyObject *bits = PyObject_CallMethod(o, "bit_length", NULL);
    if (bits == NULL) return NULL;
    Py_ssize_t nbits = PyLong_AsSsize_t(bits);
    Py_DECREF(bits);
    if (nbits < 0) return NULL;
    PyObject *meth = PyObject_GetAttrString(o, "to_bytes"), *kw = signed_kwargs();
    PyObject *args = Py_BuildValue("(ns)", nbits / 8 + 1, "little"), *out = NULL;
    if (meth != NULL && kw != NULL && args != NULL) out = PyObject_Call(meth, args, kw);
    Py_XDECREF(meth);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    return out;
}

static PyObject *big_int(PyObject *b) {
    PyObject *meth = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes"), *kw = signed_kwargs();
    PyObject *args = Py_BuildValue("(Os)", b, "little"), *out = NULL;
    if (meth != NULL && kw != NULL && args != NULL) out = PyObject_Call(meth, args, kw);
    Py_XDECREF(meth);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    return out;
}

static void key_release(Key *k) { Py_CLEAR(k->tmp); }

/* A Python block hash as a key; -1 with an exception for anything else. */
static int key_of(PyObject *o, Key *k) {
    k->tmp = NULL;
    if (PyBytes_Check(o)) {
        k->kind = K_BYTES;
        k->p = PyBytes_AS_STRING(o);
        k->len = PyBytes_GET_SIZE(o);
        if ((size_t)k->len > LEN_MASK) {
            PyErr_SetString(PyExc_ValueError, "a block hash of over 1 GiB");
            return -1;
        }
        k->fp = hash_bytes(k->p, k->len, K_BYTES);
        return 0;
    }
    if (PyLong_Check(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (!overflow) {
            if (v == -1 && PyErr_Occurred()) return -1;
            k->kind = K_INT;
            k->v = (uint64_t)v;
            k->fp = hash_int(k->v, K_INT);
            return 0;
        }
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(o);
            if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
                k->kind = K_UINT;
                k->v = (uint64_t)u;
                k->fp = hash_int(k->v, K_UINT);
                return 0;
            }
            PyErr_Clear();
        }
        /* wider than 64 bits: its shortest signed little-endian bytes */
        k->tmp = big_bytes(o);
        if (k->tmp == NULL) return -1;
        k->kind = K_BIG;
        k->p = PyBytes_AS_STRING(k->tmp);
        k->len = PyBytes_GET_SIZE(k->tmp);
        if ((size_t)k->len > LEN_MASK) {
            Py_CLEAR(k->tmp);
            PyErr_SetString(PyExc_ValueError, "a block hash of over 1 GiB");
            return -1;
        }
        k->fp = hash_bytes(k->p, k->len, K_BIG);
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a block hash is bytes or int, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

static inline int entry_is(const OMap *m, const Entry *e, const Key *k) {
    if ((int)(e->meta >> KIND_SHIFT) != k->kind) return 0;
    if (k->kind == K_INT || k->kind == K_UINT) return e->key == k->v;
    return (Py_ssize_t)(e->meta & LEN_MASK) == k->len && memcmp(m->arena + e->key, k->p, (size_t)k->len) == 0;
}

/* An entry's keyed hash, as key_of gave it. */
static inline uint64_t entry_fp(const OMap *m, const Entry *e) {
    int kind = (int)(e->meta >> KIND_SHIFT);
    if (kind == K_INT || kind == K_UINT) return hash_int(e->key, kind);
    return hash_bytes(m->arena + e->key, (Py_ssize_t)(e->meta & LEN_MASK), kind);
}

static PyObject *key_object(const OMap *m, const Entry *e) {
    int kind = (int)(e->meta >> KIND_SHIFT);
    if (kind == K_INT) return PyLong_FromLongLong((long long)e->key);
    if (kind == K_UINT) return PyLong_FromUnsignedLongLong((unsigned long long)e->key);
    PyObject *b = PyBytes_FromStringAndSize(m->arena + e->key, (Py_ssize_t)(e->meta & LEN_MASK));
    if (b == NULL || kind == K_BYTES) return b;
    PyObject *v = big_int(b);
    Py_DECREF(b);
    return v;
}

/* -- the ordered map ---------------------------------------------------------- */

static void omap_free(OMap *m) {
    PyMem_Free(m->e);
    PyMem_Free(m->ix);
    PyMem_Free(m->arena);
    memset(m, 0, sizeof(*m));
}

/* The entry holding `k` (a live one), or -1. */
static Py_ssize_t omap_find(const OMap *m, const Key *k) {
    if (!m->live) return -1;
    size_t mask = (size_t)m->ixcap - 1, i = HOME(k->fp, mask);
    for (;;) {
        uint64_t s = m->ix[i];
        if (s == EMPTY) return -1;
        if (SLOT_TAG_IS(s, k->fp)) {
            Py_ssize_t at = SLOT_AT(s);
            const Entry *e = &m->e[at];
            if (e->count && entry_is(m, e, k)) return at;
        }
        i = (i + 1) & mask;
    }
}

/* Rebuilds the index for `want` entries, dropping removed entries and their
 * bytes. Each slot of the old index goes to the new one as it is, at the
 * position its entry took (every entry has one slot, removed ones too). */
static int omap_rebuild(OMap *m, Py_ssize_t want) {
    Py_ssize_t ixcap = 8;
    while (ixcap * 2 < (want + 1) * 3) ixcap *= 2;
    uint64_t *ix = PyMem_Malloc((size_t)ixcap * sizeof(uint64_t));
    int32_t *moved = NULL; /* an entry's old position -> its new one; -1: dropped */
    if (ix != NULL && m->live < m->n) {
        moved = PyMem_Malloc((size_t)m->n * sizeof(int32_t));
        if (moved == NULL) {
            PyMem_Free(ix);
            ix = NULL;
        }
    }
    if (ix == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ix, 0xff, (size_t)ixcap * sizeof(uint64_t));
    if (moved != NULL) {
        /* compact the entries, and the arena behind them, in place */
        Py_ssize_t w = 0;
        size_t alen = 0;
        for (Py_ssize_t r = 0; r < m->n; r++) {
            Entry e = m->e[r];
            if (!e.count) {
                moved[r] = -1;
                continue;
            }
            int kind = (int)(e.meta >> KIND_SHIFT);
            if (kind == K_BYTES || kind == K_BIG) {
                size_t len = e.meta & LEN_MASK;
                memmove(m->arena + alen, m->arena + e.key, len);
                e.key = alen;
                alen += len;
            }
            moved[r] = (int32_t)w;
            m->e[w++] = e;
        }
        m->n = w;
        m->alen = alen;
        /* a map that shrank gives back what it no longer needs */
        if (m->cap > 2 * w + 16) {
            Py_ssize_t cap = w + w / GROW_BY + 8;
            Entry *e = PyMem_Realloc(m->e, (size_t)cap * sizeof(Entry));
            if (e != NULL) {
                m->e = e;
                m->cap = cap;
            }
        }
        if (m->acap > 2 * alen + 256) {
            size_t cap = alen + alen / GROW_BY + 256;
            char *a = PyMem_Realloc(m->arena, cap);
            if (a != NULL) {
                m->arena = a;
                m->acap = cap;
            }
        }
    }
    size_t mask = (size_t)ixcap - 1;
    for (Py_ssize_t j = 0; j < m->ixcap; j++) {
        uint64_t slot = m->ix[j];
        if (slot == EMPTY) continue;
        Py_ssize_t at = SLOT_AT(slot);
        if (moved != NULL && (at = moved[at]) < 0) continue;
        size_t i = HOME(slot, mask);
        while (ix[i] != EMPTY) i = (i + 1) & mask;
        ix[i] = SLOT(slot, at);
    }
    PyMem_Free(moved);
    PyMem_Free(m->ix);
    m->ix = ix;
    m->ixcap = ixcap;
    return 0;
}

/* Removed entries are a quarter of the live ones: a rebuild drops them (in
 * a map that only loses entries too, such as a window's evictions). */
static inline int too_many_removed(const OMap *m) {
    return m->n - m->live > (m->live >> 2) + 16;
}

/* `n` copies more of `k`, a new entry at the end when it has none. */
static int omap_add(OMap *m, const Key *k, uint32_t n) {
    Py_ssize_t at = omap_find(m, k);
    if (at >= 0) {
        uint32_t c = m->e[at].count;
        m->e[at].count = c > UINT32_MAX - n ? UINT32_MAX : c + n;
        return 0;
    }
    if (too_many_removed(m)) {
        if (omap_rebuild(m, m->live + 1) < 0) return -1;
    } else if ((m->n + 1) * 3 > m->ixcap * 2) {
        if (omap_rebuild(m, m->n + 1) < 0) return -1;
    }
    if (m->n >= INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a table of 2**31 entries");
        return -1;
    }
    if (m->n == m->cap) {
        Py_ssize_t cap = m->cap + m->cap / GROW_BY + 8;
        Entry *e = PyMem_Realloc(m->e, (size_t)cap * sizeof(Entry));
        if (e == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        m->e = e;
        m->cap = cap;
    }
    Entry *e = &m->e[m->n];
    e->meta = ((uint32_t)k->kind << KIND_SHIFT);
    e->count = n;
    if (k->kind == K_INT || k->kind == K_UINT) {
        e->key = k->v;
    } else {
        size_t need = m->alen + (size_t)k->len;
        if (need > m->acap) {
            size_t cap = m->acap ? m->acap : 256;
            while (cap < need) cap += cap / GROW_BY;
            char *a = PyMem_Realloc(m->arena, cap);
            if (a == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            m->arena = a;
            m->acap = cap;
        }
        memcpy(m->arena + m->alen, k->p, (size_t)k->len);
        e->key = m->alen;
        e->meta |= (uint32_t)k->len;
        m->alen = need;
    }
    size_t mask = (size_t)m->ixcap - 1, i = HOME(k->fp, mask);
    while (m->ix[i] != EMPTY) i = (i + 1) & mask;
    m->ix[i] = SLOT(k->fp, m->n);
    m->n++;
    m->live++;
    return 0;
}

static inline uint32_t omap_get(const OMap *m, const Key *k) {
    Py_ssize_t at = omap_find(m, k);
    return at < 0 ? 0 : m->e[at].count;
}

/* One copy less of `k`; 0 when it had none. */
static int omap_take(OMap *m, const Key *k) {
    Py_ssize_t at = omap_find(m, k);
    if (at < 0) return 0;
    if (--m->e[at].count == 0) {
        m->live--;
        if (!m->live) {
            /* an empty map starts over: nothing of its past is kept */
            m->n = 0;
            m->alen = 0;
            memset(m->ix, 0xff, (size_t)m->ixcap * sizeof(uint64_t));
        } else if (too_many_removed(m) && omap_rebuild(m, m->live + 1) < 0) {
            /* a map that could not be compacted stays as it is, and correct */
            PyErr_Clear();
        }
    }
    return 1;
}

/* -- Cell ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    OMap layer[3];
} Cell;

static PyTypeObject CellType;

static void Cell_dealloc(Cell *self) {
    for (int i = 0; i < 3; i++) omap_free(&self->layer[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int layer_arg(PyObject *o) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > 2) {
        PyErr_SetString(PyExc_ValueError, "layer is 0 (trusted), 1 (suspect) or 2 (placeholder)");
        return -1;
    }
    return (int)v;
}

static PyObject *Cell_store(Cell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store(hashes, placeholder)");
        return NULL;
    }
    int placeholder = PyObject_IsTrue(args[1]);
    if (placeholder < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    OMap *m = &self->layer[placeholder ? L_PLACEHOLDER : L_TRUSTED];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        if (key_of(items[i], &k) < 0 || omap_add(m, &k, 1) < 0) {
            key_release(&k);
            Py_DECREF(seq);
            return NULL;
        }
        key_release(&k);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* One copy less of each hash: trusted first, then suspect, then placeholder.
 * Returns how many had one. */
static PyObject *Cell_remove(Cell *self, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), removed = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        if (key_of(items[i], &k) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        for (int l = 0; l < 3; l++) {
            if (omap_take(&self->layer[l], &k)) {
                removed++;
                break;
            }
        }
        key_release(&k);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(removed);
}

static Key entry_key(const OMap *m, const Entry *e) {
    Key k;
    k.kind = (int)(e->meta >> KIND_SHIFT);
    k.fp = entry_fp(m, e);
    k.tmp = NULL;
    if (k.kind == K_INT || k.kind == K_UINT) {
        k.v = e->key;
        k.p = NULL;
        k.len = 0;
    } else {
        k.v = 0;
        k.p = m->arena + e->key;
        k.len = (Py_ssize_t)(e->meta & LEN_MASK);
    }
    return k;
}

/* A gap: the trusted copies become suspect ones. */
static PyObject *Cell_demote(Cell *self, PyObject *Py_UNUSED(arg)) {
    OMap *t = &self->layer[L_TRUSTED], *s = &self->layer[L_SUSPECT];
    if (!t->live) Py_RETURN_NONE;
    if (!s->live) {
        OMap tmp = *s;
        *s = *t;
        *t = tmp;
        t->n = t->live = 0;
        t->alen = 0;
        if (t->ixcap) memset(t->ix, 0xff, (size_t)t->ixcap * sizeof(uint64_t));
        Py_RETURN_NONE;
    }
    for (Py_ssize_t r = 0; r < t->n; r++) {
        const Entry *e = &t->e[r];
        if (!e->count) continue;
        Key k = entry_key(t, e);
        if (omap_add(s, &k, e->count) < 0) return NULL;
    }
    omap_free(t);
    Py_RETURN_NONE;
}

static PyObject *Cell_counts(Cell *self, PyObject *Py_UNUSED(arg)) {
    const OMap *p = &self->layer[L_PLACEHOLDER];
    unsigned long long copies = 0;
    for (Py_ssize_t r = 0; r < p->n; r++) copies += p->e[r].count;
    return Py_BuildValue("nnK", self->layer[L_TRUSTED].live, self->layer[L_SUSPECT].live, copies);
}

static PyObject *Cell_copies(Cell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copies(hash, layer)");
        return NULL;
    }
    int l = layer_arg(args[1]);
    if (l < 0) return NULL;
    Key k;
    if (key_of(args[0], &k) < 0) return NULL;
    uint32_t c = omap_get(&self->layer[l], &k);
    key_release(&k);
    return PyLong_FromUnsignedLong(c);
}

/* Trusted and suspect copies together. */
static PyObject *Cell_held(Cell *self, PyObject *h) {
    Key k;
    if (key_of(h, &k) < 0) return NULL;
    unsigned long c = omap_get(&self->layer[L_TRUSTED], &k);
    if (self->layer[L_SUSPECT].live) c += omap_get(&self->layer[L_SUSPECT], &k);
    key_release(&k);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *Cell_holds_all(Cell *self, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int all = 1;
    for (Py_ssize_t i = 0; i < n && all; i++) {
        Key k;
        if (key_of(items[i], &k) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        all = omap_find(&self->layer[L_TRUSTED], &k) >= 0 || omap_find(&self->layer[L_SUSPECT], &k) >= 0;
        key_release(&k);
    }
    Py_DECREF(seq);
    return PyBool_FromLong(all);
}

/* An entry's hash and copies, appended to two lists. */
static int append_entry(const OMap *m, const Entry *e, PyObject *keys, PyObject *copies) {
    PyObject *k = key_object(m, e), *c = k == NULL ? NULL : PyLong_FromUnsignedLong(e->count);
    int rc = c == NULL || PyList_Append(keys, k) < 0 || PyList_Append(copies, c) < 0 ? -1 : 0;
    Py_XDECREF(k);
    Py_XDECREF(c);
    return rc;
}

/* chunk(layer, at, n) -> (hashes, copies, next): up to n live entries of a
 * layer from entry position `at` on, in order; `next` is -1 past the end. */
static PyObject *Cell_chunk(Cell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chunk(layer, at, n)");
        return NULL;
    }
    int l = layer_arg(args[0]);
    if (l < 0) return NULL;
    Py_ssize_t at = PyLong_AsSsize_t(args[1]), n = PyLong_AsSsize_t(args[2]);
    if ((at == -1 || n == -1) && PyErr_Occurred()) return NULL;
    const OMap *m = &self->layer[l];
    PyObject *keys = PyList_New(0), *copies = PyList_New(0);
    if (keys == NULL || copies == NULL) goto fail;
    if (at < 0) at = 0;
    while (at < m->n && PyList_GET_SIZE(keys) < n) {
        const Entry *e = &m->e[at++];
        if (!e->count) continue;
        if (append_entry(m, e, keys, copies) < 0) goto fail;
    }
    /* past the last live entry: the caller stops without another call */
    while (at < m->n && !m->e[at].count) at++;
    return Py_BuildValue("NNn", keys, copies, at < m->n ? at : (Py_ssize_t)-1);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(copies);
    return NULL;
}

/* counts(layer, hashes) -> list of the copies each hash has in a layer. */
static PyObject *Cell_counts_of(Cell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "counts_of(layer, hashes)");
        return NULL;
    }
    int l = layer_arg(args[0]);
    if (l < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        if (key_of(items[i], &k) < 0) goto fail;
        uint32_t c = omap_get(&self->layer[l], &k);
        key_release(&k);
        PyObject *v = PyLong_FromUnsignedLong(c);
        if (v == NULL) goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* suspect_only(at, n) -> (hashes, copies, next): `chunk` of the suspect layer,
 * leaving out hashes that have trusted copies too. */
static PyObject *Cell_suspect_only(Cell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "suspect_only(at, n)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[0]), n = PyLong_AsSsize_t(args[1]);
    if ((at == -1 || n == -1) && PyErr_Occurred()) return NULL;
    const OMap *s = &self->layer[L_SUSPECT], *t = &self->layer[L_TRUSTED];
    PyObject *keys = PyList_New(0), *copies = PyList_New(0);
    if (keys == NULL || copies == NULL) goto fail;
    if (at < 0) at = 0;
    Py_ssize_t seen = 0;
    while (at < s->n && seen < n) {
        const Entry *e = &s->e[at++];
        if (!e->count) continue;
        seen++;
        Key k = entry_key(s, e);
        if (omap_find(t, &k) >= 0) continue;
        if (append_entry(s, e, keys, copies) < 0) goto fail;
    }
    while (at < s->n && !s->e[at].count) at++;
    return Py_BuildValue("NNn", keys, copies, at < s->n ? at : (Py_ssize_t)-1);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(copies);
    return NULL;
}

/* Distinct hashes with a trusted or a suspect copy. */
static PyObject *Cell_entries(Cell *self, PyObject *Py_UNUSED(arg)) {
    const OMap *t = &self->layer[L_TRUSTED], *s = &self->layer[L_SUSPECT];
    Py_ssize_t n = t->live;
    for (Py_ssize_t r = 0; r < s->n; r++) {
        if (!s->e[r].count) continue;
        Key k = entry_key(s, &s->e[r]);
        if (omap_find(t, &k) < 0) n++;
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *Cell_has_suspect(Cell *self, PyObject *Py_UNUSED(arg)) {
    return PyBool_FromLong(self->layer[L_SUSPECT].live > 0);
}

static PyObject *Cell_sizeof(Cell *self, PyObject *Py_UNUSED(arg)) {
    size_t n = sizeof(Cell);
    for (int l = 0; l < 3; l++) {
        const OMap *m = &self->layer[l];
        n += (size_t)m->cap * sizeof(Entry) + (size_t)m->ixcap * sizeof(uint64_t) + m->acap;
    }
    return PyLong_FromSize_t(n);
}

static PyMethodDef Cell_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Cell_store, METH_FASTCALL,
     "store(hashes, placeholder): one copy more of each (the placeholder layer, or the trusted one)."},
    {"remove", (PyCFunction)Cell_remove, METH_O,
     "remove(hashes) -> int: one copy less of each, trusted, else suspect, else placeholder; how many had one."},
    {"demote", (PyCFunction)Cell_demote, METH_NOARGS, "The trusted copies become suspect ones."},
    {"counts", (PyCFunction)Cell_counts, METH_NOARGS,
     "(trusted hashes, suspect hashes, placeholder copies)."},
    {"copies", (PyCFunction)(void (*)(void))Cell_copies, METH_FASTCALL, "copies(hash, layer) -> int."},
    {"held", (PyCFunction)Cell_held, METH_O, "held(hash) -> trusted and suspect copies."},
    {"holds_all", (PyCFunction)Cell_holds_all, METH_O, "Whether every hash has a trusted or suspect copy."},
    {"chunk", (PyCFunction)(void (*)(void))Cell_chunk, METH_FASTCALL,
     "chunk(layer, at, n) -> (hashes, copies, next): n entries from position at, in order; next -1 at the end."},
    {"counts_of", (PyCFunction)(void (*)(void))Cell_counts_of, METH_FASTCALL,
     "counts_of(layer, hashes) -> copies of each in the layer."},
    {"suspect_only", (PyCFunction)(void (*)(void))Cell_suspect_only, METH_FASTCALL,
     "suspect_only(at, n) -> (hashes, copies, next): chunk of the suspect layer without hashes trusted too."},
    {"entries", (PyCFunction)Cell_entries, METH_NOARGS, "Distinct hashes with a trusted or suspect copy."},
    {"has_suspect", (PyCFunction)Cell_has_suspect, METH_NOARGS, "Whether any copy is suspect."},
    {"__sizeof__", (PyCFunction)Cell_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bridge.residency._cells.Cell",
    .tp_doc = "One rank's tier: trusted, suspect and placeholder layers of hash -> copies, in insertion order.",
    .tp_basicsize = sizeof(Cell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Cell_dealloc,
    .tp_methods = Cell_methods,
};

/* -- applying a run of a group message's events ------------------------------
 *
 * `bridge.residency.index.ResidencyIndex._apply_events` over per-rank tables
 * of native cells: the loop, its stores and removals and the report-mode
 * rule (`_announced_again`, `_resumable_before`), without a Python call per
 * event; the same rules, step for step, over the same memo. An event it
 * does not read here (a subclass of the decoders' classes, a field of
 * another type than the decoders give, a size past a C long) ends the run:
 * the index applies that one in Python and calls again from the next.
 */

enum { F_OTHER = 0, F_ATTENTION = 1, F_WINDOW = 2, F_STATE = 3 };

static PyObject *S_BLOCK_HASHES, *S_MEDIUM, *S_BLOCK_SIZE, *S_WINDOW, *S_PLACEHOLDER, *S_PARENT, *S_TOKENS,
    *S_GPU, *S_CHAINS, *S_TOKENLESS, *S_STORED, *S_REMOVED, *S_UNKNOWN, *S_G_BLOCK_SIZE, *S_G_WINDOW,
    *S_REANNOUNCED, *S_NOTED, *S_REMOVE, *S_GROUP, *S_UNSORTED, *S_ADDED_COUNTS;

/* An event's fields, in the order of `rank_tables._RUN_FIELD_NAMES`. */
enum { FD_HASHES, FD_MEDIUM, FD_BLOCK_SIZE, FD_WINDOW, FD_PLACEHOLDER, FD_PARENT, FD_TOKENS, FD_N };

/* A field of an event, read through its class's member descriptor when
 * `descrs` has one (what attribute lookup would find and call, without
 * the lookup), else by name. New reference. */
static PyObject *field(PyObject *descrs, int f, PyObject *ev) {
    static PyObject **names[FD_N] = {&S_BLOCK_HASHES, &S_MEDIUM, &S_BLOCK_SIZE, &S_WINDOW, &S_PLACEHOLDER,
                                     &S_PARENT, &S_TOKENS};
    PyObject *d = descrs != NULL ? PyTuple_GET_ITEM(descrs, f) : Py_None;
    if (d != Py_None && Py_TYPE(d)->tp_descr_get != NULL)
        return Py_TYPE(d)->tp_descr_get(d, ev, (PyObject *)Py_TYPE(ev));
    return PyObject_GetAttr(ev, *names[f]);
}

/* The cell of `medium` in a group's media dict, made when `make`; NULL
 * (no exception) when there is none. */
static Cell *media_cell(PyObject *media, PyObject *medium, int make) {
    PyObject *c = PyDict_GetItemWithError(media, medium);
    if (c != NULL || PyErr_Occurred() || !make) return (Cell *)c;
    c = PyType_GenericNew(&CellType, NULL, NULL);
    if (c == NULL) return NULL;
    int rc = PyDict_SetItem(media, medium, c);
    Py_DECREF(c); /* the dict holds it */
    return rc < 0 ? NULL : (Cell *)c;
}

/* slot_cells[group], made when `make`. Borrowed. */
static PyObject *group_media(PyObject *slot_cells, PyObject *group, int make) {
    PyObject *m = PyDict_GetItemWithError(slot_cells, group);
    if (m != NULL || PyErr_Occurred() || !make) return m;
    m = PyDict_New();
    if (m == NULL) return NULL;
    int rc = PyDict_SetItem(slot_cells, group, m);
    Py_DECREF(m);
    return rc < 0 ? NULL : m;
}

/* Whether a group's GPU tier holds `k` (trusted or suspect copies). -1: error. */
static int gpu_holds(PyObject *media, const Key *k) {
    if (media == NULL) return 0;
    Cell *c = media_cell(media, S_GPU, 0);
    if (c == NULL) return PyErr_Occurred() ? -1 : 0;
    return omap_find(&c->layer[L_TRUSTED], k) >= 0 || omap_find(&c->layer[L_SUSPECT], k) >= 0;
}

/* Token ids a store carries: a list's length, or the count in an encoded
 * msgpack array's header (0 for anything else). */
static Py_ssize_t token_count(PyObject *tokens) {
    if (PyList_CheckExact(tokens)) return PyList_GET_SIZE(tokens);
    Py_buffer v;
    if (PyObject_GetBuffer(tokens, &v, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return 0;
    }
    const unsigned char *p = v.buf;
    Py_ssize_t n = 0;
    if (v.len >= 1 && (p[0] & 0xF0) == 0x90) n = p[0] & 0x0F;
    else if (v.len >= 3 && p[0] == 0xDC) n = (p[1] << 8) | p[2];
    else if (v.len >= 5 && p[0] == 0xDD) n = ((Py_ssize_t)p[1] << 24) | (p[2] << 16) | (p[3] << 8) | p[4];
    PyBuffer_Release(&v);
    return n;
}

static int add_to_attr(PyObject *o, PyObject *name, Py_ssize_t n) {
    if (!n) return 0;
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    PyObject *d = PyLong_FromSsize_t(n), *sum = d ? PyNumber_Add(v, d) : NULL;
    Py_DECREF(v);
    Py_XDECREF(d);
    if (sum == NULL) return -1;
    int rc = PyObject_SetAttr(o, name, sum);
    Py_DECREF(sum);
    return rc;
}

/* The copies each hash of a store adds (`hashes`: a list) to a cell layer. */
static int cell_add_all(Cell *c, PyObject *hashes, int placeholder) {
    OMap *m = &c->layer[placeholder ? L_PLACEHOLDER : L_TRUSTED];
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        if (key_of(PyList_GET_ITEM(hashes, i), &k) < 0 || omap_add(m, &k, 1) < 0) {
            key_release(&k);
            return -1;
        }
        key_release(&k);
    }
    return 0;
}

static Py_ssize_t cell_take_all(Cell *c, PyObject *hashes) {
    Py_ssize_t n = PyList_GET_SIZE(hashes), removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        if (key_of(PyList_GET_ITEM(hashes, i), &k) < 0) return -1;
        for (int l = 0; l < 3; l++) {
            if (omap_take(&c->layer[l], &k)) {
                removed++;
                break;
            }
        }
        key_release(&k);
    }
    return removed;
}

/* What the rule reads of a run: the rank's tables, the group being applied
 * (its shape as the run has taught it so far) and the batch position's memo. */
typedef struct {
    PyObject *slot_cells, *g, *group;
    long family, block_size;
    PyObject *window;
    PyObject *memo, *others, *media, *descrs;
    Py_ssize_t reannounced;
} Run;

/* `prefix.window_blocks`: blocks a window must hold before a hit; -1 unknown. */
static long window_blocks(PyObject *window, long block_size) {
    if (window == Py_None || !PyLong_Check(window) || block_size <= 0) return -1;
    int of = 0;
    long w = PyLong_AsLongAndOverflow(window, &of);
    if (of < 0 || (!of && w <= 0)) return -1;
    if (of > 0) return LONG_MAX / 2; /* more blocks than any chain has */
    return (w - 1 + block_size - 1) / block_size;
}

/* An `others` entry's window blocks; a window past a C long needs more
 * blocks than any chain has. */
static long other_window_blocks(PyObject *t) {
    int of = 0;
    long wb = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(t, 2), &of);
    return of > 0 ? LONG_MAX / 2 : wb;
}

/* `prefix.needed_before`. */
static Py_ssize_t needed_before(long family, long wb, Py_ssize_t k) {
    if (k <= 0) return 0;
    if (family == F_STATE) return 1;
    if (family == F_WINDOW && wb >= 0) return wb < k ? (Py_ssize_t)wb : k;
    return k;
}

/* Trusted and suspect GPU copies of `h` in a group's media; -1: error. */
static long gpu_copies(PyObject *media, PyObject *h) {
    if (media == NULL) return 0;
    Cell *c = media_cell(media, S_GPU, 0);
    if (c == NULL) return PyErr_Occurred() ? -1 : 0;
    Key k;
    if (key_of(h, &k) < 0) return -1;
    long n = (long)omap_get(&c->layer[L_TRUSTED], &k) + (long)omap_get(&c->layer[L_SUSPECT], &k);
    key_release(&k);
    return n;
}

/* The memo's `added` (`_Reannounced.added`): its notes not counted yet
 * folded into its Counter first, as the property does. New reference. */
static PyObject *memo_added(PyObject *memo) {
    PyObject *unsorted = PyObject_GetAttr(memo, S_UNSORTED), *added = PyObject_GetAttr(memo, S_ADDED_COUNTS);
    if (unsorted == NULL || added == NULL || !PyList_Check(unsorted) || !PyDict_Check(added)) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(unsorted); i++) {
        PyObject *note = PyList_GET_ITEM(unsorted, i), *group = PyTuple_GET_ITEM(note, 0),
                 *stored = PyTuple_GET_ITEM(note, 1);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(stored); j++) {
            PyObject *key = PyTuple_Pack(2, group, PyList_GET_ITEM(stored, j));
            if (key == NULL) goto fail;
            PyObject *v = PyDict_GetItemWithError(added, key);
            long n = v == NULL ? 0 : PyLong_AsLong(v);
            PyObject *w = PyErr_Occurred() ? NULL : PyLong_FromLong(n + 1);
            int rc = w == NULL ? -1 : PyDict_SetItem(added, key, w);
            Py_DECREF(key);
            Py_XDECREF(w);
            if (rc < 0) goto fail;
        }
    }
    if (PyList_SetSlice(unsorted, 0, PyList_GET_SIZE(unsorted), NULL) < 0) goto fail;
    Py_DECREF(unsorted);
    return added;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a report-mode memo of another shape");
    Py_XDECREF(unsorted);
    Py_XDECREF(added);
    return NULL;
}

/* `_Reannounced.note`: copies a store added at this batch position. */
static int memo_note(PyObject *memo, PyObject *group, PyObject *stored) {
    PyObject *unsorted = PyObject_GetAttr(memo, S_UNSORTED), *noted = PyObject_GetAttr(memo, S_NOTED);
    PyObject *note = unsorted && noted ? PyTuple_Pack(2, group, stored) : NULL;
    int rc = note == NULL || !PyList_Check(unsorted) || PyList_Append(unsorted, note) < 0
        || PySet_Add(noted, group) < 0 ? -1 : 0;
    if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a report-mode memo of another shape");
    Py_XDECREF(unsorted);
    Py_XDECREF(noted);
    Py_XDECREF(note);
    return rc;
}

/* One ruled group's say in `_resumable_before`'s second test. 1: allows
 * resuming at k = len(chain); 0: not; -1: error. */
static int group_allows(Run *r, PyObject *gno, long family, long wb, PyObject *media, PyObject *chain,
                        PyObject *noted, PyObject **added) {
    Py_ssize_t k = PyList_GET_SIZE(chain), need = needed_before(family, wb, k);
    int in_noted = PySet_Contains(noted, gno);
    if (in_noted < 0) return -1;
    for (Py_ssize_t i = k - 1; i >= k - need; i--) {
        PyObject *h = PyList_GET_ITEM(chain, i);
        long held = gpu_copies(media, h);
        if (held < 0) return -1;
        if (in_noted) {
            /* copies this batch position stored are left out, block by block */
            if (*added == NULL && (*added = memo_added(r->memo)) == NULL) return -1;
            PyObject *key = PyTuple_Pack(2, gno, h);
            if (key == NULL) return -1;
            PyObject *a = PyDict_GetItemWithError(*added, key);
            Py_DECREF(key);
            long n = 0;
            if (a != NULL) n = PyLong_AsLong(a);
            if (PyErr_Occurred()) return -1;
            held -= n;
        }
        if (held <= 0) return 0;
    }
    return 1;
}

/* `ResidencyIndex._resumable_before`: the hybrid prefix rule at
 * k = len(chain) on the GPU tier, the copies this batch position stored
 * left out. 1, 0, or -1 on error. */
static int resumable_before(Run *r, PyObject *chain, const Key *last) {
    long self_wb = r->family == F_WINDOW ? window_blocks(r->window, r->block_size) : -1;
    int self_ruled = r->family != F_OTHER;
    PyObject *self_media = r->media != NULL ? r->media : group_media(r->slot_cells, r->group, 0);
    if (PyErr_Occurred()) return -1;
    /* every group that needs a block at all needs the last one: one lookup
     * each rejects most stores (a fresh request's) */
    if (self_ruled && (r->family != F_WINDOW || self_wb != 0)) {
        int h = gpu_holds(self_media, last);
        if (h <= 0) return h;
    }
    Py_ssize_t no = PyTuple_GET_SIZE(r->others);
    for (Py_ssize_t o = 0; o < no; o++) {
        PyObject *t = PyTuple_GET_ITEM(r->others, o);
        long family = PyLong_AsLong(PyTuple_GET_ITEM(t, 1)), wb = other_window_blocks(t);
        if (PyErr_Occurred()) return -1;
        if (family == F_WINDOW && wb == 0) continue;
        PyObject *m = group_media(r->slot_cells, PyTuple_GET_ITEM(t, 0), 0);
        if (m == NULL && PyErr_Occurred()) return -1;
        int h = gpu_holds(m, last);
        if (h <= 0) return h;
    }
    if (!self_ruled && no == 0) return 0; /* no group constrains a prefix */
    PyObject *noted = PyObject_GetAttr(r->memo, S_NOTED), *added = NULL;
    if (noted == NULL) return -1;
    int ok = 1;
    if (self_ruled) ok = group_allows(r, r->group, r->family, self_wb, self_media, chain, noted, &added);
    for (Py_ssize_t o = 0; ok == 1 && o < no; o++) {
        PyObject *t = PyTuple_GET_ITEM(r->others, o), *gno = PyTuple_GET_ITEM(t, 0);
        long family = PyLong_AsLong(PyTuple_GET_ITEM(t, 1)), wb = other_window_blocks(t);
        PyObject *m = group_media(r->slot_cells, gno, 0);
        if (PyErr_Occurred()) ok = -1;
        else ok = group_allows(r, gno, family, wb, m, chain, noted, &added);
    }
    Py_DECREF(noted);
    Py_XDECREF(added);
    return ok;
}

/* A chain announced again: the tokenless stores of the same chain at this
 * batch position are taken back (they added copies no removal will take). */
static int take_back(Run *r, PyObject *key) {
    PyObject *tokenless = PyObject_GetAttr(r->memo, S_TOKENLESS), *keep = PyList_New(0), *added = NULL;
    int rc = tokenless != NULL && keep != NULL && PyList_Check(tokenless) ? 0 : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(tokenless); i++) {
        PyObject *item = PyList_GET_ITEM(tokenless, i);
        PyObject *other = PyTuple_GET_ITEM(item, 0), *hashes = PyTuple_GET_ITEM(item, 1),
                 *copies = PyTuple_GET_ITEM(item, 2);
        int same = PyObject_RichCompareBool(hashes, key, Py_EQ);
        if (same < 0) {
            rc = -1;
            break;
        }
        if (!same) {
            rc = PyList_Append(keep, item);
            continue;
        }
        PyObject *res = PyObject_CallMethodObjArgs(other, S_REMOVE, S_GPU, copies, NULL);
        Py_XDECREF(res);
        Py_ssize_t n = PyList_GET_SIZE(copies);
        if (res == NULL || add_to_attr(other, S_REMOVED, -n) < 0 || add_to_attr(other, S_STORED, -n) < 0) {
            rc = -1;
            break;
        }
        PyObject *gno = PyObject_GetAttr(other, S_GROUP);
        if (gno == NULL || (added == NULL && (added = memo_added(r->memo)) == NULL)) {
            Py_XDECREF(gno);
            rc = -1;
            break;
        }
        for (Py_ssize_t j = 0; rc == 0 && j < n; j++) {
            PyObject *k = PyTuple_Pack(2, gno, PyList_GET_ITEM(copies, j));
            PyObject *v = k ? PyObject_GetItem(added, k) : NULL; /* a Counter: 0 when missing */
            PyObject *one = PyLong_FromLong(1);
            PyObject *less = v && one ? PyNumber_Subtract(v, one) : NULL;
            if (less == NULL || PyObject_SetItem(added, k, less) < 0) rc = -1;
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_XDECREF(one);
            Py_XDECREF(less);
        }
        Py_DECREF(gno);
        r->reannounced++;
    }
    if (rc == 0) rc = PyObject_SetAttr(r->memo, S_TOKENLESS, keep);
    Py_XDECREF(tokenless);
    Py_XDECREF(keep);
    Py_XDECREF(added);
    return rc;
}

/* `ResidencyIndex._announced_again` for a parent-less GPU store: 1 when it
 * is vLLM announcing a prefix hit again (nothing is stored), 0 when it
 * stores (noted at this batch position), -1 on error. */
static int announced_again(Run *r, PyObject *ev, PyObject *chain, PyObject *stored, long ev_bs) {
    PyObject *chains = PyObject_GetAttr(r->memo, S_CHAINS);
    if (chains == NULL) return -1;
    if (PySet_GET_SIZE(chains) > 0) {
        PyObject *key = PySequence_Tuple(chain);
        int hit = key == NULL ? -1 : PySet_Contains(chains, key);
        Py_XDECREF(key);
        if (hit != 0) {
            Py_DECREF(chains);
            if (hit > 0) r->reannounced++;
            return hit;
        }
    }
    PyObject *tok = field(r->descrs, FD_TOKENS, ev);
    if (tok == NULL) {
        Py_DECREF(chains);
        return -1;
    }
    Py_ssize_t tokens = token_count(tok), nh = PyList_GET_SIZE(chain);
    Py_DECREF(tok);
    if (tokens && ev_bs > 0 && nh > 0 && tokens / nh >= ev_bs) {
        Key last;
        if (key_of(PyList_GET_ITEM(chain, nh - 1), &last) < 0) {
            Py_DECREF(chains);
            return -1;
        }
        int yes = resumable_before(r, chain, &last);
        key_release(&last);
        if (yes) {
            int rc = yes < 0 ? -1 : 0;
            PyObject *key = rc == 0 ? PySequence_Tuple(chain) : NULL;
            if (rc == 0 && (key == NULL || PySet_Add(chains, key) < 0)) rc = -1;
            if (rc == 0) {
                r->reannounced++;
                rc = take_back(r, key);
            }
            Py_XDECREF(key);
            Py_DECREF(chains);
            return rc < 0 ? -1 : 1;
        }
    }
    Py_DECREF(chains);
    if (memo_note(r->memo, r->group, stored) < 0) return -1;
    if (!tokens) {
        PyObject *tl = PyObject_GetAttr(r->memo, S_TOKENLESS);
        PyObject *key = PySequence_Tuple(chain), *copies = PySequence_List(stored);
        PyObject *item = tl && key && copies ? PyTuple_Pack(3, r->g, key, copies) : NULL;
        int rc = item == NULL || PyList_Append(tl, item) < 0 ? -1 : 0;
        Py_XDECREF(tl);
        Py_XDECREF(key);
        Py_XDECREF(copies);
        Py_XDECREF(item);
        if (rc < 0) return -1;
    }
    return 0;
}

/* The index in `kinds` of an event's exact class; `n` when none. */
static Py_ssize_t kind_of(PyTypeObject *const *kind_t, Py_ssize_t n, PyTypeObject *t) {
    Py_ssize_t k = 0;
    while (k < n && kind_t[k] != t) k++;
    return k;
}

/* A kind's member descriptors, or NULL (read by name) when `fields` holds none for it. */
static PyObject *run_descrs(PyObject *fields, Py_ssize_t kind) {
    PyObject *d = PyTuple_GET_ITEM(fields, kind);
    return PyTuple_Check(d) && PyTuple_GET_SIZE(d) == FD_N ? d : NULL;
}

/* The tables a run's lookups go to: the trusted layer of each tier of the
 * group, and of each other ruled group's GPU tier (the report-mode rule's).
 * Their cells are held for the run, so that one a take-back drops stays
 * readable. */
#define MAX_AHEAD_MAPS 8
typedef struct {
    PyObject *cells[MAX_AHEAD_MAPS];
    int n;
} Ahead;

static void ahead_add(Ahead *a, PyObject *cell) {
    if (cell == NULL || a->n == MAX_AHEAD_MAPS || !PyObject_TypeCheck(cell, &CellType)) return;
    for (int j = 0; j < a->n; j++)
        if (a->cells[j] == cell) return;
    Py_INCREF(cell);
    a->cells[a->n++] = cell;
}

static void ahead_init(Ahead *a, PyObject *slot_cells, PyObject *group, PyObject *others) {
    a->n = 0;
    PyObject *media = PyDict_GetItemWithError(slot_cells, group);
    if (media != NULL && PyDict_Check(media)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(media, &pos, &k, &v)) ahead_add(a, v);
    }
    for (Py_ssize_t o = 0; o < PyTuple_GET_SIZE(others); o++) {
        PyObject *t = PyTuple_GET_ITEM(others, o);
        PyObject *m = PyTuple_Check(t) && PyTuple_GET_SIZE(t) > 0
            ? PyDict_GetItemWithError(slot_cells, PyTuple_GET_ITEM(t, 0)) : NULL;
        if (m != NULL && PyDict_Check(m)) ahead_add(a, PyDict_GetItemWithError(m, S_GPU));
    }
    PyErr_Clear(); /* a lookup that failed only loses a prefetch */
}

static void ahead_release(Ahead *a) {
    for (int j = 0; j < a->n; j++) Py_DECREF(a->cells[j]);
    a->n = 0;
}

/* Asks the CPU to fetch the index slots an event's hashes will be probed at
 * while the event before it is applied: in tables of 100,000 entries each
 * probe's first read is a cache miss, and these overlap where probes one
 * after another would wait for each in turn. Only bytes hashes; nothing
 * is read but the event's hash list. */
static void ahead_fetch(const Ahead *a, PyObject *descrs, PyObject *ev) {
    if (!a->n) return;
    PyObject *hashes = field(descrs, FD_HASHES, ev);
    if (hashes == NULL) {
        PyErr_Clear();
        return;
    }
    if (PyList_Check(hashes)) {
        Py_ssize_t n = PyList_GET_SIZE(hashes);
        for (Py_ssize_t i = 0; i < n && i < 32; i++) {
            PyObject *h = PyList_GET_ITEM(hashes, i);
            if (!PyBytes_Check(h)) continue;
            uint64_t fp = hash_bytes(PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h), K_BYTES);
            for (int j = 0; j < a->n; j++) {
                const OMap *m = &((Cell *)a->cells[j])->layer[L_TRUSTED];
                if (m->live) __builtin_prefetch(&m->ix[HOME(fp, (size_t)m->ixcap - 1)]);
            }
        }
    }
    Py_DECREF(hashes);
}

/* apply_run(slot_cells, g, group, family, events, start, memo, others, kinds, index, fields) -> int
 *
 * slot_cells: the rank's group -> medium -> Cell dict; g: the group's
 * GroupResidency (block_size, window and its counters are written back);
 * group: its number; family: F_* code; events: the message's list; start:
 * the first event to apply; memo: the batch position's `_Reannounced`;
 * others: (number, F_* code, window blocks or -1 when unknown) of the
 * rank's other ruled groups; kinds: the exact classes it reads,
 * BlockRemoved first, then the stores' (LeanStored, BlockStored, and any
 * class with a store's fields); index: the ResidencyIndex (its
 * `reannounced_ignored`); fields: per kind, its fields' member descriptors
 * (None: read by name).
 * Returns the index of the event the caller must apply itself, or
 * len(events) when the run is done. */
static PyObject *apply_run(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "apply_run takes 11 arguments");
        return NULL;
    }
    PyObject *slot_cells = args[0], *g = args[1], *group = args[2], *events = args[4], *memo = args[6],
             *others = args[7], *kinds = args[8], *index = args[9], *fields = args[10];
    long family = PyLong_AsLong(args[3]);
    Py_ssize_t i = PyLong_AsSsize_t(args[5]);
    if ((family == -1 || i == -1) && PyErr_Occurred()) return NULL;
    if (!PyDict_Check(slot_cells) || !PyList_Check(events) || !PyTuple_Check(others) || !PyTuple_Check(kinds)
        || PyTuple_GET_SIZE(kinds) < 2 || PyTuple_GET_SIZE(kinds) > MAX_KINDS || !PyTuple_Check(fields)
        || PyTuple_GET_SIZE(fields) != PyTuple_GET_SIZE(kinds)) {
        PyErr_SetString(PyExc_TypeError, "apply_run: slot_cells dict, events list, others tuple, and kinds and "
                                         "fields tuples of one length (2 to 8)");
        return NULL;
    }
    /* kinds[0] is the removal's class; every other one a store's */
    Py_ssize_t nkinds = PyTuple_GET_SIZE(kinds);
    PyTypeObject *kind_t[MAX_KINDS];
    for (Py_ssize_t j = 0; j < nkinds; j++) kind_t[j] = (PyTypeObject *)PyTuple_GET_ITEM(kinds, j);
    PyObject *v = PyObject_GetAttr(g, S_G_BLOCK_SIZE);
    if (v == NULL) return NULL;
    int overflow = 0;
    long block_size = PyLong_AsLongAndOverflow(v, &overflow), block_size0;
    Py_DECREF(v);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (overflow) return PyLong_FromSsize_t(i); /* sizes past a C long: the index's own loop */
    block_size0 = block_size;
    PyObject *window = PyObject_GetAttr(g, S_G_WINDOW); /* owned */
    if (window == NULL) return NULL;
    PyObject *window0 = window;
    Py_INCREF(window0);
    Py_ssize_t stored = 0, removed = 0, unknown = 0, reannounced = 0, n = PyList_GET_SIZE(events);
    int failed = 0;
    PyObject *media = NULL; /* this group's, borrowed from slot_cells */
    Ahead ahead;
    ahead_init(&ahead, slot_cells, group, others);

    for (; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        PyTypeObject *t = Py_TYPE(ev);
        PyObject *medium = NULL, *hashes = NULL;
        Py_ssize_t kind = kind_of(kind_t, nkinds, t);
        if (kind == nkinds) break; /* a class not named (a subclass, say): the index's own loop */
        if (i + 1 < n) {
            PyObject *next = PyList_GET_ITEM(events, i + 1);
            Py_ssize_t nk = kind_of(kind_t, nkinds, Py_TYPE(next));
            if (nk < nkinds) ahead_fetch(&ahead, run_descrs(fields, nk), next);
        }
        int is_removal = kind == 0;
        PyObject *descrs = run_descrs(fields, kind);
        medium = field(descrs, FD_MEDIUM, ev);
        hashes = field(descrs, FD_HASHES, ev);
        if (medium == NULL || hashes == NULL || !PyList_Check(hashes)) {
            Py_XDECREF(medium);
            Py_XDECREF(hashes);
            if (PyErr_Occurred()) failed = 1;
            break;
        }
        /* the state rule reads the medium as sent; the tier is GPU's when none is named */
        int sent_none_or_gpu = medium == Py_None
            || (PyUnicode_Check(medium) && PyUnicode_CompareWithASCIIString(medium, "GPU") == 0);
        if (medium == Py_None || (PyUnicode_Check(medium) && PyUnicode_GET_LENGTH(medium) == 0)) {
            Py_DECREF(medium);
            medium = Py_NewRef(S_GPU);
        }
        if (is_removal) {
            PyObject *m = media != NULL ? media : group_media(slot_cells, group, 0);
            Cell *c = m == NULL ? NULL : media_cell(m, medium, 0);
            if (PyErr_Occurred()) {
                failed = 1;
            } else if (c == NULL) {
                unknown += PyList_GET_SIZE(hashes);
            } else {
                Py_ssize_t r = cell_take_all(c, hashes);
                if (r < 0) failed = 1;
                else {
                    removed += r;
                    unknown += PyList_GET_SIZE(hashes) - r;
                }
            }
            Py_DECREF(medium);
            Py_DECREF(hashes);
            if (failed) break;
            continue;
        }
        /* a store: its block size and window teach the group */
        long ev_bs = 0, ev_placeholder = 0;
        PyObject *a = field(descrs, FD_BLOCK_SIZE, ev), *w = NULL, *ph = NULL, *parent = NULL;
        if (a == NULL || (ev_bs = PyLong_AsLongAndOverflow(a, &overflow)) == -1) failed = PyErr_Occurred() != NULL;
        Py_XDECREF(a);
        if (!failed && overflow) {
            Py_DECREF(medium);
            Py_DECREF(hashes);
            break;
        }
        if (!failed && (ph = field(descrs, FD_PLACEHOLDER, ev)) != NULL) {
            ev_placeholder = PyObject_IsTrue(ph);
            Py_DECREF(ph);
            if (ev_placeholder < 0) failed = 1;
        } else failed = 1;
        if (!failed && (w = field(descrs, FD_WINDOW, ev)) == NULL) failed = 1;
        if (!failed && w != Py_None && !PyLong_CheckExact(w)) {
            Py_DECREF(w);
            Py_DECREF(medium);
            Py_DECREF(hashes);
            break;
        }
        if (failed) {
            Py_DECREF(medium);
            Py_DECREF(hashes);
            break;
        }
        if (ev_bs > 0 && ev_bs != block_size && !ev_placeholder) block_size = ev_bs;
        int truthy = PyObject_IsTrue(w);
        if (truthy < 0) failed = 1;
        else if (truthy) {
            Py_DECREF(window);
            window = w;
            w = NULL;
        }
        Py_XDECREF(w);
        if (failed) {
            Py_DECREF(medium);
            Py_DECREF(hashes);
            break;
        }
        int gpu = PyUnicode_Check(medium) && PyUnicode_CompareWithASCIIString(medium, "GPU") == 0;
        PyObject *stored_hashes = hashes; /* the contract's rule for state groups */
        Py_INCREF(stored_hashes);
        if (family == F_STATE && !sent_none_or_gpu && PyList_GET_SIZE(hashes) >= 2) {
            Py_DECREF(stored_hashes);
            stored_hashes = PyList_GetSlice(hashes, PyList_GET_SIZE(hashes) - 1, PyList_GET_SIZE(hashes));
            if (stored_hashes == NULL) {
                Py_DECREF(medium);
                Py_DECREF(hashes);
                failed = 1;
                break;
            }
        }
        int placeholder = family == F_WINDOW && (ev_placeholder || ev_bs == 0);
        int skip = 0;
        if (!placeholder && gpu && PyList_GET_SIZE(stored_hashes) > 0) {
            parent = field(descrs, FD_PARENT, ev);
            if (parent == NULL) failed = 1;
            else if (parent == Py_None) {
                /* report mode "full": ResidencyIndex._announced_again */
                Run r = {slot_cells, g, group, family, block_size, window, memo, others, media, descrs, 0};
                int again = announced_again(&r, ev, hashes, stored_hashes, ev_bs);
                reannounced += r.reannounced;
                if (again < 0) failed = 1;
                else if (again) skip = 1;
            }
            Py_XDECREF(parent);
        }
        if (!failed && !skip) {
            if (media == NULL) media = group_media(slot_cells, group, 1);
            Cell *c = media == NULL ? NULL : media_cell(media, medium, 1);
            if (c == NULL || cell_add_all(c, stored_hashes, placeholder) < 0) failed = 1;
            else stored += PyList_GET_SIZE(stored_hashes);
        }
        Py_DECREF(stored_hashes);
        Py_DECREF(medium);
        Py_DECREF(hashes);
        if (failed) break;
    }
    ahead_release(&ahead);
    /* what the run taught the group, and its counters */
    if (block_size != block_size0) {
        PyObject *b = PyLong_FromLong(block_size);
        if (b == NULL || PyObject_SetAttr(g, S_G_BLOCK_SIZE, b) < 0) failed = 1;
        Py_XDECREF(b);
    }
    if (window != window0 && PyObject_SetAttr(g, S_G_WINDOW, window) < 0) failed = 1;
    Py_DECREF(window);
    Py_DECREF(window0);
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (failed) PyErr_Fetch(&et, &ev, &tb);
    if (add_to_attr(g, S_STORED, stored) < 0 || add_to_attr(g, S_REMOVED, removed) < 0
        || add_to_attr(g, S_UNKNOWN, unknown) < 0 || add_to_attr(index, S_REANNOUNCED, reannounced) < 0) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
    }
    if (et != NULL) {
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    return PyLong_FromSsize_t(i); /* a run cut short with nothing raised: the caller applies event i */
}

static PyMethodDef module_methods[] = {
    {"apply_run", (PyCFunction)(void (*)(void))apply_run, METH_FASTCALL,
     "apply_run(slot_cells, g, group, family, events, start, memo, others, kinds, index, fields) -> index of the "
     "event "
     "left to the caller, or len(events)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cells", "Native tiers for bridge.residency.rank_tables.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cells(void) {
    if (getrandom(&SEED, sizeof(SEED), 0) != (ssize_t)sizeof(SEED)) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if (PyType_Ready(&CellType) < 0) return NULL;
    struct { PyObject **slot; const char *text; } names[] = {
        {&S_BLOCK_HASHES, "block_hashes"}, {&S_MEDIUM, "medium"}, {&S_BLOCK_SIZE, "block_size"},
        {&S_WINDOW, "kv_cache_spec_sliding_window"}, {&S_PLACEHOLDER, "placeholder"},
        {&S_PARENT, "parent_block_hash"}, {&S_TOKENS, "token_ids"}, {&S_GPU, "GPU"},
        {&S_CHAINS, "chains"}, {&S_TOKENLESS, "tokenless"}, {&S_STORED, "stored"}, {&S_REMOVED, "removed"},
        {&S_UNKNOWN, "unknown_removals"}, {&S_G_BLOCK_SIZE, "block_size"}, {&S_G_WINDOW, "window"},
        {&S_REANNOUNCED, "reannounced_ignored"}, {&S_NOTED, "noted"}, {&S_REMOVE, "remove"},
        {&S_GROUP, "group"}, {&S_UNSORTED, "_unsorted"}, {&S_ADDED_COUNTS, "_added"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CellType);
    if (PyModule_AddObject(m, "Cell", (PyObject *)&CellType) < 0) {
        Py_DECREF(&CellType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
