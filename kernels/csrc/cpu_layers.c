/* The decoder layers of a one-request CPU decode step as one call, and the thread team that
   shares its matmuls (radixlm.kernels.cpu_decode builds this together with quant_gemv.c and
   cpu_decode.c, whose pieces it runs). No Python between a layer's pieces, and the weights read in
   the order the arena placed them, so each matmul's prefetch runs into the next one's rows. With
   more than one thread each matmul's output columns and the attention's query heads are split,
   the rest runs on the caller's thread; every value is computed exactly as with one thread. */
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---- the team: the caller is thread 0, workers 1 .. MAXT - 1 are started on first use ---- */
#define MAXT 16
#define SPIN_WAKE 20000  /* pause loops a worker spins for its next job before it sleeps */
#define SPIN_YIELD 4000  /* pause loops a barrier spins before it yields the core */

typedef void (*JobFn)(const void *args, int tid, int nt);

typedef struct { /* one worker's doorbell, on its own cache line */
    _Alignas(64) _Atomic uint32_t go; /* bumped for each job this worker is part of */
    atomic_int sleeping;
    uint32_t start; /* go when the worker was started: its jobs are the bumps after it */
} Mailbox;

static struct {
    pthread_mutex_t busy; /* one job at a time: a caller that finds the team busy runs alone */
    int workers;          /* started */
    pid_t pid;            /* the process that started them (a forked child has none) */
    JobFn fn;             /* the job: set before the doorbells ring, read once by each worker */
    const void *args;
    int nt;
    atomic_int arrived; /* the barrier */
    _Atomic uint32_t phase;
    Mailbox mail[MAXT];
} team = {.busy = PTHREAD_MUTEX_INITIALIZER};

static void futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

/* all nt threads of the job meet here; *phase is the thread's copy of the team's phase */
static void sync_team(int nt, uint32_t *phase) {
    if (nt == 1) return;
    const uint32_t next = *phase + 1;
    *phase = next;
    if (atomic_fetch_add(&team.arrived, 1) == nt - 1) {
        atomic_store(&team.arrived, 0);
        atomic_store(&team.phase, next);
        return;
    }
    /* until the phase reaches next: later jobs without this thread may have moved it further
       before this thread looks again */
    for (int spins = 0; (int32_t)(atomic_load(&team.phase) - next) < 0;)
        if (++spins < SPIN_YIELD) _mm_pause();
        else { sched_yield(); spins = 0; }
}

static void *worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    Mailbox *mb = &team.mail[tid];
    for (uint32_t seen = mb->start;; seen++) {
        for (int spins = 0; atomic_load(&mb->go) == seen;) {
            if (++spins < SPIN_WAKE) { _mm_pause(); continue; }
            atomic_store(&mb->sleeping, 1);
            futex(&mb->go, FUTEX_WAIT_PRIVATE, seen);
            atomic_store(&mb->sleeping, 0);
            spins = 0;
        }
        team.fn(team.args, tid, team.nt);
    }
    return NULL;
}

/* fn(args, tid, nt) on nt threads (this one is tid 0); returns once all have reached fn's last
   sync_team, which must end it: args live on the caller's stack, so fn copies what it reads of
   them before that barrier. Runs alone where the team is busy or cannot start. */
static void run_job(JobFn fn, const void *args, int nt) {
    if (nt > MAXT) nt = MAXT;
    if (nt <= 1 || pthread_mutex_trylock(&team.busy) != 0) { fn(args, 0, 1); return; }
    if (team.pid != getpid()) team.workers = 0; /* threads do not survive fork */
    team.pid = getpid();
    while (team.workers < nt - 1) {
        pthread_t t;
        team.mail[team.workers + 1].start = atomic_load(&team.mail[team.workers + 1].go);
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)(team.workers + 1)) != 0) break;
        pthread_detach(t);
        team.workers++;
    }
    if (team.workers < nt - 1) nt = team.workers + 1;
    team.fn = fn, team.args = args, team.nt = nt;
    for (int t = 1; t < nt; t++) {
        atomic_fetch_add(&team.mail[t].go, 1);
        if (atomic_load(&team.mail[t].sleeping)) futex(&team.mail[t].go, FUTEX_WAKE_PRIVATE, 1);
    }
    fn(args, 0, nt);
    pthread_mutex_unlock(&team.busy);
}

/* [lo, hi) of n items for thread tid of nt, in steps of `align` */
static inline void share(int64_t n, int64_t align, int tid, int nt, int64_t *lo, int64_t *hi) {
    const int64_t per = ((n + nt - 1) / nt + align - 1) / align * align;
    *lo = per * tid < n ? per * tid : n;
    *hi = *lo + per < n ? *lo + per : n;
}

static void matmul_share(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int fmt, float *y,
                         int tid, int nt) {
    int64_t lo, hi;
    share(n, COL_ALIGN, tid, nt, &lo, &hi);
    if (lo < hi) matmul_cols(x, m, k, w, n, fmt, y, lo, hi);
}

/* ---- one matmul on the team (the LM head: the largest weight) ---- */
typedef struct {
    const float *x;
    int64_t m, k, n;
    const uint8_t *w;
    int fmt;
    float *y;
} MatmulJob;

static void matmul_job(const void *args, int tid, int nt) {
    const MatmulJob job = *(const MatmulJob *)args, *j = &job;
    uint32_t phase = atomic_load(&team.phase);
    matmul_share(j->x, j->m, j->k, j->w, j->n, j->fmt, j->y, tid, nt);
    sync_team(nt, &phase);
}

void matmul_threads(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int fmt, float *y, int nt) {
    const MatmulJob j = {x, m, k, n, w, fmt, y};
    run_job(matmul_job, &j, nt);
}

/* ---- the decoder layers ---- */
typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const uint8_t *qkv, *o, *gate_up, *down; /* repacked GGUF rows (quant_gemv.c) */
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    float *k, *v; /* this layer's KV pool [slots, hkv, d] */
} DecodeLayer;

typedef struct {
    int64_t hidden, inter, hq, hkv, d;
    float eps, scale;
} DecodeShape;

typedef struct {
    const DecodeLayer *layers;
    int64_t nlayers, n, max_len;
    const DecodeShape *s;
    const float *c, *sn;
    const int64_t *new_slots, *const *row_slots, *row_lens;
    float *h, *residual, *buf;
} LayersJob;

static void layers_job(const void *args, int tid, int nt) {
    /* copies: the caller's job and shape may be gone once the last barrier lets it return */
    const LayersJob job = *(const LayersJob *)args, *j = &job;
    const DecodeShape shape = *j->s, *s = &shape;
    const int64_t n = j->n, H = s->hidden, I = s->inter, qkv_w = (s->hq + 2 * s->hkv) * s->d,
                  attn_w = s->hq * s->d;
    float *x = j->buf, *sum = x + n * H, *qkv = sum + n * H, *attn = qkv + n * qkv_w, *gu = attn + n * attn_w,
          *act = gu + n * 2 * I, *h = j->h, *residual = j->residual;
    float *work = (float *)malloc(sizeof(float) * (s->d + j->max_len));
    uint32_t phase = atomic_load(&team.phase);
    int64_t h0, h1, c0, c1;
    share(s->hq, 1, tid, nt, &h0, &h1);
    share(I, 8, tid, nt, &c0, &c1);
    for (int64_t l = 0; l < j->nlayers; l++) {
        const DecodeLayer *L = j->layers + l;
        if (tid == 0) add_rmsnorm(h, l ? residual : NULL, L->attn_norm, s->eps, n, H, sum, x);
        sync_team(nt, &phase);
        matmul_share(x, n, H, L->qkv, qkv_w, L->qkv_fmt, qkv, tid, nt);
        sync_team(nt, &phase);
        if (tid == 0)
            for (int64_t i = 0; i < n; i++)
                store_kv(qkv + i * qkv_w, s->hq, s->hkv, s->d, j->c + i * s->d, j->sn + i * s->d, L->k, L->v,
                         j->new_slots[i]);
        sync_team(nt, &phase);
        for (int64_t i = 0; i < n; i++)
            attend_heads(qkv + i * qkv_w, s->hq, s->hkv, s->d, j->c + i * s->d, j->sn + i * s->d, L->k, L->v,
                         j->row_slots[i], j->row_lens[i], s->scale, h0, h1, work, attn + i * attn_w);
        sync_team(nt, &phase);
        matmul_share(attn, n, attn_w, L->o, H, L->o_fmt, h, tid, nt);
        sync_team(nt, &phase);
        if (tid == 0) add_rmsnorm(h, sum, L->mlp_norm, s->eps, n, H, residual, x);
        sync_team(nt, &phase);
        matmul_share(x, n, H, L->gate_up, 2 * I, L->gate_up_fmt, gu, tid, nt);
        sync_team(nt, &phase);
        silu_mul_cols(gu, n, I, c0, c1, act);
        sync_team(nt, &phase);
        matmul_share(act, n, I, L->down, H, L->down_fmt, h, tid, nt);
        sync_team(nt, &phase);
    }
    free(work);
}

/* n new tokens through every layer on nt threads: one request's few tokens, or one decode token of
   each of n requests. h [n, hidden] is the token embedding (the first layer norms it alone: no
   residual yet); on return h is the last layer's output and residual [n, hidden] the stream
   before it, as LlamaDecoderLayer leaves them. cos/sin [n, d] are the tokens' rope rows and
   new_slots their KV slots; token i attends to the row_lens[i] slots at row_slots[i], its own
   last (every token's K and V are stored before any attends). */
void decode_layers(const DecodeLayer *layers, int64_t nlayers, const DecodeShape *s, int64_t n, const float *c,
                   const float *sn, const int64_t *new_slots, const int64_t *const *row_slots,
                   const int64_t *row_lens, float *h, float *residual, int nt) {
    const int64_t qkv_w = (s->hq + 2 * s->hkv) * s->d;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = row_lens[i] > max_len ? row_lens[i] : max_len;
    float *buf = (float *)malloc(sizeof(float) * n * (2 * s->hidden + qkv_w + s->hq * s->d + 3 * s->inter));
    const LayersJob j = {layers, nlayers, n, max_len, s, c, sn, new_slots, row_slots, row_lens, h, residual, buf};
    run_job(layers_job, &j, nt);
    free(buf);
}
