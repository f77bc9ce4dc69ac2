/* memra_obs.tail._scan: the tail's line scanner for the three shapes that make up almost
 * every legacy line ([spec-prof-rounds] rows, phase lines, level-2 lines), in C.
 *
 * Why: in CPython the regex, the float() calls and the per-line dispatch of these lines
 * cost ~4 us a line, most of the tail's budget (README, tail section). This module does the
 * same work as memra_obs.legacy's fast patterns (FAST_ROW_LINES, FAST_PHASE, FAST_VERIFY)
 * and the conversions memra_obs.tail.core applies to their groups, once per chunk.
 *
 * It is conservative by construction: a line it takes is one the fast patterns take, with
 * the same values (floats as float() gives them: up to 15 digits by an exact division,
 * else by PyOS_string_to_double, float()'s own parser; f32 by a C cast, as struct's "f"
 * and array('f') do; Python's round() half-even); anything it is not
 * sure of (a tag with a byte outside printable ASCII, a number too long for its buffer, an
 * excluded tag) comes back as a plain line for the Python path, which gives every reason.
 * tests/test_tail_scan.py holds it to the pure-Python path line for line.
 *
 *   scan(text) -> (events, rows, n_lines, n_plain)
 *
 * ``text``: whole lines, each ending in "\n". ``events``: in line order, one tuple each:
 *   (0, line, a, z)          rows a..z of ``rows`` (consecutive lines from ``line``)
 *   (1, line, tag, values)   a phase line: (rounds, k, total, draft, ..., per-round total)
 *   (2, line, tag, values)   a level-2 line: (rounds, k, vkda, scan, vmla, vrest, vffn)
 *   (3, line, text)          a line starting with "[" for the Python path
 * ``line`` is 0-based within ``text``. ``rows``: None or the columns (row, wall, draft,
 * verify, accept, rest ns, (k, j, ctx, seq_rows)). ``n_plain``: lines not starting with
 * "[" (other programs' lines), which get no event.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* The fast decimal path needs each operation rounded once, to double (SSE2, not x87). */
#if defined(__FLT_EVAL_METHOD__) && __FLT_EVAL_METHOD__ == 0
#define EXACT_DOUBLES 1
#else
#define EXACT_DOUBLES 0
#endif

typedef struct {
    const char *p; /* cursor */
    const char *e; /* end of the line (excluding the "\n") */
} Cur;

static int lit(Cur *c, const char *s, Py_ssize_t n) {
    if (c->e - c->p < n || memcmp(c->p, s, (size_t)n) != 0) return 0;
    c->p += n;
    return 1;
}
#define LIT(c, s) lit((c), (s), (Py_ssize_t)(sizeof(s) - 1))

static int isdig(char ch) { return ch >= '0' && ch <= '9'; }

/* (0|[1-9][0-9]{0,max-1}) followed by a non-digit: the regex's count shapes. */
static int count(Cur *c, int max, long long *out) {
    const char *p = c->p;
    if (p >= c->e || !isdig(*p)) return 0;
    const char *q = p;
    while (q < c->e && isdig(*q)) q++;
    Py_ssize_t n = q - p;
    if (n > max || (n > 1 && *p == '0')) return 0;
    long long v = 0;
    for (; p < q; p++) v = v * 10 + (*p - '0');
    *out = v;
    c->p = q;
    return 1;
}

/* [0-9]{1,maxint}\.[0-9]+ (sign: -? in front when ``sign``), parsed as float() would. */
static int decimal(Cur *c, int sign, int maxint, double *out) {
    const char *p = c->p;
    const char *s = p;
    if (sign && p < c->e && *p == '-') p++;
    const char *q = p;
    while (q < c->e && isdig(*q)) q++;
    if (q == p || (maxint > 0 && q - p > maxint)) return 0;
    if (q >= c->e || *q != '.') return 0;
    q++;
    const char *f = q;
    while (q < c->e && isdig(*q)) q++;
    if (q == f) return 0;
    /* Few digits (the usual case): the digits as an integer M < 2**53 and the fraction's
     * length f <= 22 are exact doubles, and IEEE division rounds correctly, so M / 10**f is
     * the double nearest the decimal: float()'s result, without its parser. */
    Py_ssize_t nd = (q - f) + (f - 1 - p);
    if (EXACT_DOUBLES && nd <= 15 && q - f <= 22) {
        static const double p10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                       1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                       1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
        long long m = 0;
        for (const char *d = p; d < q; d++)
            if (*d != '.') m = m * 10 + (*d - '0');
        double v = (double)m / p10[q - f];
        *out = (s < p) ? -v : v;
        c->p = q;
        return 1;
    }
    char buf[72];
    Py_ssize_t n = q - s;
    if (n >= (Py_ssize_t)sizeof(buf)) return 0; /* long: the Python path */
    memcpy(buf, s, (size_t)n);
    buf[n] = '\0';
    char *end = NULL;
    double v = PyOS_string_to_double(buf, &end, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (end != buf + n) return 0;
    *out = v;
    c->p = q;
    return 1;
}

/* Trailing "\r"s, then the end of the line. */
static int eol(Cur *c) {
    while (c->p < c->e && *c->p == '\r') c->p++;
    return c->p == c->e;
}

/* round(float) of Python: half to even, as an int object. */
static PyObject *py_round(double x) {
    double r = round(x);
    if (fabs(x - r) == 0.5) r = 2.0 * round(x / 2.0);
    if (r > -9.0e18 && r < 9.0e18) return PyLong_FromLongLong((long long)r);
    return PyLong_FromDouble(r);
}

static const char ROW_HEAD[] = "[spec-prof-rounds] ";

typedef struct {
    long long idx, k, j, ctx, seq;
    double v[5]; /* wall, draft, verify, accept, rest (ms, as parsed) */
} Row;

static int parse_row(Cur *c, Row *r) {
    static const char *const names[5] = {" wall_ms=", " draft_ms=", " verify_ms=",
                                         " accept_ms=", " rest_ms="};
    if (!LIT(c, "row=") || !count(c, 4, &r->idx)) return 0;
    for (int i = 0; i < 5; i++) {
        if (!lit(c, names[i], (Py_ssize_t)strlen(names[i]))) return 0;
        if (!decimal(c, 0, 30, &r->v[i])) return 0;
    }
    return LIT(c, " k=") && count(c, 4, &r->k) && LIT(c, " j=") && count(c, 4, &r->j) &&
           LIT(c, " ctx=") && count(c, 9, &r->ctx) && LIT(c, " seq_rows=") &&
           count(c, 4, &r->seq) && eol(c);
}

/* "[tag] ": printable ASCII but "]" (a subset of the regex's [^\]\s]+). */
static int tag(Cur *c, const char **t, Py_ssize_t *tn) {
    if (!LIT(c, "[")) return 0;
    const char *p = c->p;
    while (p < c->e && *p != ']') {
        unsigned char ch = (unsigned char)*p;
        if (ch <= 0x20 || ch >= 0x7f) return 0;
        p++;
    }
    if (p == c->p || p >= c->e) return 0;
    *t = c->p;
    *tn = p - c->p;
    c->p = p + 1;
    return LIT(c, " ");
}

static int excluded(const char *t, Py_ssize_t n) {
    static const char *const tags[4] = {"spec-prof", "spec-prof-rounds", "spec-prof-summary",
                                        "spec-trace"};
    for (int i = 0; i < 4; i++)
        if ((Py_ssize_t)strlen(tags[i]) == n && memcmp(t, tags[i], (size_t)n) == 0) return 1;
    return 0;
}

/* rounds=N k=N — the counts of both line shapes. */
static int head(Cur *c, long long *rounds, long long *k) {
    return LIT(c, "rounds=") && count(c, 18, rounds) && LIT(c, " k=") && count(c, 18, k);
}

static int parse_phase(Cur *c, long long *rounds, long long *k, double *v) {
    static const char *const a[5] = {" draft=", " verify=", " accept=", " roll=", " maint="};
    static const char *const b[6] = {" draft=", " verify=", " accept=", " roll=", " maint=",
                                     " total="};
    if (!head(c, rounds, k) || !LIT(c, " total=") || !decimal(c, 1, 0, &v[0]) ||
        !LIT(c, "ms |"))
        return 0;
    for (int i = 0; i < 5; i++)
        if (!lit(c, a[i], (Py_ssize_t)strlen(a[i])) || !decimal(c, 1, 0, &v[1 + i])) return 0;
    if (!LIT(c, " | per-round ms:")) return 0;
    for (int i = 0; i < 6; i++)
        if (!lit(c, b[i], (Py_ssize_t)strlen(b[i])) || !decimal(c, 1, 0, &v[6 + i])) return 0;
    return eol(c);
}

static int parse_verify(Cur *c, long long *rounds, long long *k, double *v) {
    return head(c, rounds, k) && LIT(c, " | per-round ms: vkda=") && decimal(c, 1, 0, &v[0]) &&
           LIT(c, " (scan=") && decimal(c, 1, 0, &v[1]) && LIT(c, ") vmla=") &&
           decimal(c, 1, 0, &v[2]) && LIT(c, " vrest=") && decimal(c, 1, 0, &v[3]) &&
           LIT(c, " (vffn=") && decimal(c, 1, 0, &v[4]) && LIT(c, ")") && eol(c);
}

static int append_new(PyObject *list, PyObject *item) { /* steals ``item`` */
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

static PyObject *values(long long rounds, long long k, const double *v, int n) {
    PyObject *t = PyTuple_New(2 + n);
    if (t == NULL) return NULL;
    PyObject *x;
    if ((x = PyLong_FromLongLong(rounds)) == NULL) goto fail;
    PyTuple_SET_ITEM(t, 0, x);
    if ((x = PyLong_FromLongLong(k)) == NULL) goto fail;
    PyTuple_SET_ITEM(t, 1, x);
    for (int i = 0; i < n; i++) {
        if ((x = PyFloat_FromDouble(v[i])) == NULL) goto fail;
        PyTuple_SET_ITEM(t, 2 + i, x);
    }
    return t;
fail:
    Py_DECREF(t);
    return NULL;
}

/* The open run of rows, as its event: (0, first line, first row, end row). */
static int close_run(PyObject *events, long long *run_line, long long run_a, long long nrows) {
    if (*run_line < 0) return 0;
    PyObject *ev = Py_BuildValue("(iLLL)", 0, *run_line, run_a, nrows);
    *run_line = -1;
    return append_new(events, ev);
}

static PyObject *scan(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "scan() takes a str");
        return NULL;
    }
    Py_ssize_t size;
    const char *buf = PyUnicode_AsUTF8AndSize(arg, &size);
    if (buf == NULL) return NULL;
    PyObject *events = PyList_New(0);
    PyObject *cols[7] = {NULL};
    PyObject *rows = NULL, *tags = NULL, *out = NULL;
    if (events == NULL) goto done;
    if ((tags = PyDict_New()) == NULL) goto done;
    const char *p = buf, *end = buf + size;
    long long line = 0, plain = 0, nrows = 0;
    long long run_line = -1, run_a = 0; /* the open run of rows: its first line, first row */
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl ? nl : end;
        Cur c = {p, e};
        const int row_head = e - p >= (Py_ssize_t)sizeof(ROW_HEAD) - 1 &&
                             memcmp(p, ROW_HEAD, sizeof(ROW_HEAD) - 1) == 0;
        if (row_head) {
            Row r;
            c.p += sizeof(ROW_HEAD) - 1;
            if (parse_row(&c, &r)) {
                if (cols[0] == NULL)
                    for (int i = 0; i < 7; i++)
                        if ((cols[i] = PyList_New(0)) == NULL) goto done;
                if (append_new(cols[0], PyLong_FromLongLong(r.idx)) < 0) goto done;
                for (int i = 0; i < 5; i++)
                    if (append_new(cols[1 + i], py_round((double)(float)r.v[i] * 1e6)) < 0)
                        goto done;
                if (append_new(cols[6], Py_BuildValue("(LLLL)", r.k, r.j, r.ctx, r.seq)) < 0)
                    goto done;
                if (run_line < 0) {
                    run_line = line;
                    run_a = nrows;
                }
                nrows++;
                goto next;
            }
        }
        /* Not a row: the run of rows before it (if any) ends here. */
        if (close_run(events, &run_line, run_a, nrows) < 0) goto done;
        if (e == p || *p != '[') {
            plain++;
            goto next;
        }
        if (!row_head) { /* (a refused row goes to the Python path, which says why) */
            const char *t;
            Py_ssize_t tn;
            if (tag(&c, &t, &tn) && !excluded(t, tn)) {
                long long rounds = 0, k = 0;
                double v[12];
                Cur c2 = c;
                int kind = 0, nv = 0;
                if (parse_phase(&c, &rounds, &k, v)) {
                    kind = 1;
                    nv = 12;
                } else if (parse_verify(&c2, &rounds, &k, v)) {
                    kind = 2;
                    nv = 5;
                }
                if (kind) {
                    PyObject *key = PyUnicode_FromStringAndSize(t, tn);
                    if (key == NULL) goto done;
                    PyObject *ts = PyDict_SetDefault(tags, key, key); /* one str a tag */
                    Py_DECREF(key);
                    if (ts == NULL) goto done;
                    PyObject *vals = values(rounds, k, v, nv);
                    if (vals == NULL) goto done;
                    if (append_new(events, Py_BuildValue("(iLON)", kind, line, ts, vals)) < 0)
                        goto done;
                    goto next;
                }
            }
        }
        {
            PyObject *text = PyUnicode_DecodeUTF8(p, e - p, "strict");
            if (text == NULL) goto done;
            if (append_new(events, Py_BuildValue("(iLN)", 3, line, text)) < 0) goto done;
        }
    next:
        line++;
        p = nl ? nl + 1 : end;
    }
    if (close_run(events, &run_line, run_a, nrows) < 0) goto done;
    if (cols[0] != NULL) {
        rows = PyTuple_New(7);
        if (rows == NULL) goto done;
        for (int i = 0; i < 7; i++) {
            PyTuple_SET_ITEM(rows, i, cols[i]);
            cols[i] = NULL;
        }
    } else {
        rows = Py_None;
        Py_INCREF(rows);
    }
    out = Py_BuildValue("(OOLL)", events, rows, line, plain);
done:
    Py_XDECREF(events);
    Py_XDECREF(rows);
    Py_XDECREF(tags);
    for (int i = 0; i < 7; i++) Py_XDECREF(cols[i]);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "scan(text) -> (events, rows, n_lines, n_plain); see the module."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan", "The tail's line scanner (memra_obs.tail.core).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
