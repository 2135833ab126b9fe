// Optimizer steps on a parameter in place, PyTorch's rules exactly as the CPU backend's
// (src/backends/cpu/optim.rs): state in f32 (f64 for f64 parameters), constants rounded
// to the state type before use.
//
// Each update also notes, in the word *bad, the smallest slot (the update's number in the
// step) whose new value, as stored, is NaN or infinite: training stops there rather than
// saving NaN weights, and the check is one compare per element of a pass already made.

template <class T> __device__ void store_param(T* p, typename Num<T>::A v, unsigned* bad, unsigned slot) {
    T s = st<T>(v);
    *p = s;
    if (!isfinite(ld(s))) atomicMin(bad, slot);
}

template <class T> __device__ void sgd_k(T* p, const T* g, typename Num<T>::A* buf, i64 n, double lr, double mu, double wd, unsigned* bad, unsigned slot) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) {
        A pv = ld(p[i]);
        A d = ld(g[i]) + (A)wd * pv;
        if (buf) {
            buf[i] = (A)mu * buf[i] + d;
            d = buf[i];
        }
        store_param(&p[i], pv - (A)lr * d, bad, slot);
    }
}

// SGD over several parameters in one launch (PyTorch's foreach step): a training step's
// dozen small updates would otherwise each cost a launch. `end` holds the running element
// counts; a thread finds its tensor by a short scan (count ≤ SGD_MAX, uniform in a warp
// except at a boundary). Same rule per element as sgd_k.
#define SGD_MAX 16
struct SgdTensors {
    u64 p[SGD_MAX], g[SGD_MAX], buf[SGD_MAX];
    i64 end[SGD_MAX];
    unsigned slot[SGD_MAX];
    int count;
};
template <class T> __device__ void sgd_multi_k(SgdTensors t, double lr, double mu, double wd, unsigned* bad) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, t.end[t.count - 1]) {
        int k = 0;
        while (i >= t.end[k]) ++k;
        i64 j = i - (k ? t.end[k - 1] : 0);
        T* p = (T*)t.p[k];
        A* buf = (A*)t.buf[k];
        A pv = ld(p[j]);
        A d = ld(((const T*)t.g[k])[j]) + (A)wd * pv;
        if (buf) {
            buf[j] = (A)mu * buf[j] + d;
            d = buf[j];
        }
        store_param(&p[j], pv - (A)lr * d, bad, t.slot[k]);
    }
}

// p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps); AdamW decays p first, Adam adds wd·p to g.
// The step t comes from the device word *tp (a recorded step stays valid as t grows), or
// from `t_host` where there is none.
template <class T> __device__ void adam_k(T* p, const T* g, typename Num<T>::A* m, typename Num<T>::A* v, i64 n, const u64* tp, u64 t_host, double lr, double b1, double b2, double eps, double wd, double decay, int decoupled, unsigned* bad, unsigned slot) {
    typedef typename Num<T>::A A;
    double t = (double)(tp ? *tp : t_host);
    double step_size = lr / (1.0 - pow(b1, t)), sq_bc2 = sqrt(1.0 - pow(b2, t));
    GRID_STRIDE(i, n) {
        A pv = ld(p[i]), gv = ld(g[i]);
        if (decoupled) pv = pv * (A)decay;
        else gv = gv + (A)wd * pv;
        m[i] = (A)b1 * m[i] + ((A)1 - (A)b1) * gv;
        v[i] = (A)b2 * v[i] + ((A)1 - (A)b2) * gv * gv;
        store_param(&p[i], pv - (A)step_size * m[i] / (m_sqrt(v[i]) / (A)sq_bc2 + (A)eps), bad, slot);
    }
}

// Gradient accumulation over micro-batches: acc = scale·g (first) or acc += scale·g, in
// the gradient's type, summed in the accumulating type (the CPU's accumulate).
template <class T> __device__ void accumulate_k(T* acc, const T* g, i64 n, double scale, int first) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) {
        A v = (A)scale * ld(g[i]);
        acc[i] = st<T>(first ? v : ld(acc[i]) + v);
    }
}

#define INST_OPT(T, S)                                                                            \
    extern "C" __global__ void sgd_##S(T* p, const T* g, Num<T>::A* b, i64 n, double lr, double mu, double wd, unsigned* bad, unsigned slot) { sgd_k<T>(p, g, b, n, lr, mu, wd, bad, slot); } \
    extern "C" __global__ void sgd_multi_##S(SgdTensors t, double lr, double mu, double wd, unsigned* bad) { sgd_multi_k<T>(t, lr, mu, wd, bad); } \
    extern "C" __global__ void adam_##S(T* p, const T* g, Num<T>::A* m, Num<T>::A* v, i64 n, const u64* tp, u64 th, double lr, double b1, double b2, double eps, double wd, double decay, int dec, unsigned* bad, unsigned slot) { adam_k<T>(p, g, m, v, n, tp, th, lr, b1, b2, eps, wd, decay, dec, bad, slot); } \
    extern "C" __global__ void accumulate_##S(T* acc, const T* g, i64 n, double scale, int first) { accumulate_k<T>(acc, g, n, scale, first); }
FOR_FLOATS(INST_OPT)
