// Makes a GGUF file with a real model's exact tensor names, shapes and types, its metadata and its
// full vocabulary, but deterministic random weights: a stand-in for speed benchmarks, whose
// output is noise. Built and run by scripts/model-shapes, linked against ggml's core library.
//
//   model-shapes SHAPE FTYPE VOCAB.gguf OUT.gguf
//
// SHAPE is llama-3.2-1b, llama-3.1-8b or qwen2.5-1.5b; FTYPE Q4_K_M or Q8_0; VOCAB.gguf one of
// llama.cpp's vocab-only files (scripts/llama-vocab), whose tokenizer.* keys are copied. The
// hyperparameter keys are those llama.cpp's convert_hf_to_gguf.py writes for the real model
// (and llama-quantize's general.quantization_version); the tensors come in the order
// llama-quantize writes them (non-layer tensors, then layer by layer, each sorted by name), each
// with the type llama_tensor_get_type (src/llama-quant.cpp) picks for the file type.
//
// Weights: a splitmix64 stream per tensor, seeded from its name, summed four 16-bit uniforms at a
// time into roughly N(0, 1) values; sigma 0.02 for token_embd/output and biases, 1/sqrt(fan_in)
// for the layer matrices; norms are 1. Each tensor is generated and quantized (ggml_quantize_chunk,
// no importance matrix) 256 rows at a time and appended after the metadata, so memory stays small.

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "gguf.h"

#define MAX_TENSORS 1024
#define CHUNK_ROWS 256

struct shape {
    const char *name, *arch, *title;
    int n_layer, hidden, n_head, n_kv, head_dim, ffn, vocab;
    uint32_t context;
    float rope_base, rms_eps;
    float rope_factor;  // Llama 3's rope scaling factor: a rope_freqs tensor when > 0
    bool key_length;    // the HF config has head_dim: convert writes attention.key/value_length
    bool qkv_bias;      // Qwen2: q/k/v biases
    bool tied;          // no output.weight: the output reuses token_embd
};

// Llama-3.2-1B is made untied on purpose (the real one ties its output to token_embd): ~1.5B
// parameters, the cost of a separate 128256-row output matmul included. Its rope_scaling factor
// is 32 (Llama 3.1: 8). Qwen2.5-1.5B is the Instruct model's config (context 32768); its
// vocab file already holds the padded 151936 tokens of the real embedding.
static const struct shape SHAPES[] = {
    {"llama-3.2-1b", "llama", "Llama-3.2-1B shape, random weights", 16, 2048, 32, 8, 64, 8192,
     128256, 131072, 500000.0f, 1e-5f, 32.0f, true, false, false},
    {"llama-3.1-8b", "llama", "Llama-3.1-8B shape, random weights", 32, 4096, 32, 8, 128, 14336,
     128256, 131072, 500000.0f, 1e-5f, 8.0f, false, false, false},
    {"qwen2.5-1.5b", "qwen2", "Qwen2.5-1.5B shape, random weights", 28, 1536, 12, 2, 128, 8960,
     151936, 32768, 1000000.0f, 1e-6f, 0.0f, false, true, true},
};

enum init { RANDOM, ONES, ROPE_FREQS };

struct tensor {
    char name[64];
    int64_t ne0, ne1;  // ggml order: ne0 is the row length (the input width of a matrix)
    enum init init;
    float sigma;
    enum ggml_type type;
};

static struct tensor tensors[MAX_TENSORS];
static int n_tensors;

static void die(const char *msg, const char *arg) {
    fprintf(stderr, "model-shapes: %s%s\n", msg, arg);
    exit(1);
}

// llama-quant.cpp's rule for the layers that get more bits in Q4_K_M/Q5_K_M.
static bool use_more_bits(int i, int n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

// llama_tensor_get_type for these shapes: 1-D tensors stay F32; Q8_0 quantizes every matrix to
// Q8_0; Q4_K_M gives output.weight (or a tied token_embd, which serves as the output) Q6_K,
// attn_v and ffn_down Q6_K in the use_more_bits layers, everything else Q4_K.
static enum ggml_type pick_type(const struct tensor *t, bool q8, bool tied, int layer, int n_layer) {
    if (t->ne1 == 1) {
        return GGML_TYPE_F32;
    }
    enum ggml_type type = GGML_TYPE_Q4_K;
    if (q8) {
        type = GGML_TYPE_Q8_0;
    } else if (strcmp(t->name, "output.weight") == 0 ||
               (tied && strcmp(t->name, "token_embd.weight") == 0)) {
        type = GGML_TYPE_Q6_K;
    } else if ((strstr(t->name, ".attn_v.weight") || strstr(t->name, ".ffn_down.weight")) &&
               use_more_bits(layer, n_layer)) {
        type = GGML_TYPE_Q6_K;
    }
    if (t->ne0 % ggml_blck_size(type) != 0) {  // llama.cpp would fall back; not for these shapes
        die("row length not divisible by the block size: ", t->name);
    }
    return type;
}

static void add(const char *name, int64_t ne0, int64_t ne1, enum init init, float sigma) {
    if (n_tensors == MAX_TENSORS) {
        die("too many tensors", "");
    }
    struct tensor *t = &tensors[n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ne0 = ne0;
    t->ne1 = ne1;
    t->init = init;
    t->sigma = sigma;
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Sum of four uniform 16-bit integers (mean 131070, sd 37837.2), standardized: roughly N(0, 1),
// bounded by +-3.46.
static float gauss(uint64_t *s) {
    uint64_t r = splitmix64(s);
    double sum = (double)(r & 0xffff) + (double)(r >> 16 & 0xffff) + (double)(r >> 32 & 0xffff) +
                 (double)(r >> 48);
    return (float)((sum - 131070.0) / 37837.23);
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    }
    return h;
}

// Llama 3.1's per-pair frequency divisors, as convert_hf_to_gguf.py computes rope_freqs.weight
// (low_freq_factor 1, high_freq_factor 4, original context 8192).
static void rope_freqs(const struct shape *m, float *out) {
    const double old_ctx = 8192, low = 1, high = 4, pi = 3.14159265358979323846;
    for (int i = 0; i < m->head_dim / 2; i++) {
        double freq = 1.0 / pow(m->rope_base, 2.0 * i / m->head_dim);
        double wavelen = 2 * pi / freq;
        if (wavelen < old_ctx / high) {
            out[i] = 1.0f;
        } else if (wavelen > old_ctx / low) {
            out[i] = m->rope_factor;
        } else {
            double smooth = (old_ctx / wavelen - low) / (high - low);
            out[i] = (float)(1.0 / ((1 - smooth) / m->rope_factor + smooth));
        }
    }
}

static void write_or_die(const void *p, size_t n, FILE *f) {
    if (n > 0 && fwrite(p, 1, n, f) != n) {
        die("write failed", "");
    }
}

// Writes tensor t's data at the file's current position, CHUNK_ROWS rows at a time.
static void write_tensor(const struct shape *m, const struct tensor *t, FILE *f) {
    uint64_t seed = fnv1a(t->name);
    const int64_t rows = t->ne1 < CHUNK_ROWS ? t->ne1 : CHUNK_ROWS;
    float *f32 = malloc((size_t)(rows * t->ne0) * sizeof(float));
    void *q = malloc(ggml_row_size(t->type, t->ne0) * (size_t)rows);
    if (f32 == NULL || q == NULL) {
        die("out of memory", "");
    }
    for (int64_t r0 = 0; r0 < t->ne1; r0 += rows) {
        const int64_t nr = t->ne1 - r0 < rows ? t->ne1 - r0 : rows;
        const int64_t n = nr * t->ne0;
        for (int64_t i = 0; i < n; i++) {
            f32[i] = t->init == ONES ? 1.0f : t->sigma * gauss(&seed);
        }
        if (t->init == ROPE_FREQS) {
            rope_freqs(m, f32);
        }
        if (t->type == GGML_TYPE_F32) {
            write_or_die(f32, (size_t)n * sizeof(float), f);
            continue;
        }
        size_t size = ggml_row_size(t->type, t->ne0) * (size_t)nr;
        size_t done = ggml_quantize_chunk(t->type, f32, q, 0, nr, t->ne0, NULL);
        if (done != size) {
            die("quantized size mismatch in ", t->name);
        }
        write_or_die(q, size, f);
    }
    free(f32);
    free(q);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: model-shapes SHAPE Q4_K_M|Q8_0 VOCAB.gguf OUT.gguf\n");
        return 2;
    }
    const struct shape *m = NULL;
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        if (strcmp(SHAPES[i].name, argv[1]) == 0) {
            m = &SHAPES[i];
        }
    }
    if (m == NULL) {
        die("unknown shape ", argv[1]);
    }
    bool q8 = strcmp(argv[2], "Q8_0") == 0;
    if (!q8 && strcmp(argv[2], "Q4_K_M") != 0) {
        die("unknown file type ", argv[2]);
    }

    // The vocabulary: every tokenizer.* key of the vocab file, nothing else of it.
    struct gguf_init_params vp = {.no_alloc = true, .ctx = NULL};
    struct gguf_context *vocab = gguf_init_from_file(argv[3], vp);
    if (vocab == NULL) {
        die("cannot read ", argv[3]);
    }
    int64_t tok = gguf_find_key(vocab, "tokenizer.ggml.tokens");
    if (tok < 0 || (int64_t)gguf_get_arr_n(vocab, tok) != m->vocab) {
        fprintf(stderr, "model-shapes: %s has %zu tokens, %s needs %d\n", argv[3],
                tok < 0 ? (size_t)0 : gguf_get_arr_n(vocab, tok), m->name, m->vocab);
        return 1;
    }
    struct gguf_context *tokenizer = gguf_init_empty();
    gguf_set_kv(tokenizer, vocab);
    for (int64_t i = gguf_get_n_kv(tokenizer) - 1; i >= 0; i--) {
        if (strncmp(gguf_get_key(tokenizer, i), "tokenizer.", 10) != 0) {
            gguf_remove_key(tokenizer, gguf_get_key(tokenizer, i));
        }
    }

    // Metadata in convert_hf_to_gguf.py's order: general.*, the hyperparameters, the tokenizer.
    struct gguf_context *g = gguf_init_empty();
    char key[128];
#define KEY(k) (snprintf(key, sizeof key, "%s.%s", m->arch, k), key)
    gguf_set_val_str(g, "general.architecture", m->arch);
    gguf_set_val_str(g, "general.type", "model");
    gguf_set_val_str(g, "general.name", m->title);
    gguf_set_val_u32(g, KEY("block_count"), (uint32_t)m->n_layer);
    gguf_set_val_u32(g, KEY("context_length"), m->context);
    gguf_set_val_u32(g, KEY("embedding_length"), (uint32_t)m->hidden);
    gguf_set_val_u32(g, KEY("feed_forward_length"), (uint32_t)m->ffn);
    gguf_set_val_u32(g, KEY("attention.head_count"), (uint32_t)m->n_head);
    gguf_set_val_u32(g, KEY("attention.head_count_kv"), (uint32_t)m->n_kv);
    gguf_set_val_f32(g, KEY("rope.freq_base"), m->rope_base);
    gguf_set_val_f32(g, KEY("attention.layer_norm_rms_epsilon"), m->rms_eps);
    if (m->key_length) {
        gguf_set_val_u32(g, KEY("attention.key_length"), (uint32_t)m->head_dim);
        gguf_set_val_u32(g, KEY("attention.value_length"), (uint32_t)m->head_dim);
    }
    gguf_set_val_u32(g, "general.file_type", q8 ? 7 : 15);  // LLAMA_FTYPE_MOSTLY_Q8_0 / Q4_K_M
    if (strcmp(m->arch, "llama") == 0) {  // LlamaModel adds these; Qwen2Model does not
        gguf_set_val_u32(g, KEY("vocab_size"), (uint32_t)m->vocab);
        gguf_set_val_u32(g, KEY("rope.dimension_count"), (uint32_t)m->head_dim);
    }
    gguf_set_kv(g, tokenizer);
    gguf_set_val_u32(g, "general.quantization_version", GGML_QNT_VERSION);

    // The tensors, in llama-quantize's order.
    const int64_t h = m->hidden, q_dim = (int64_t)m->n_head * m->head_dim,
                  kv_dim = (int64_t)m->n_kv * m->head_dim, f = m->ffn;
    if (!m->tied) {
        add("output.weight", h, m->vocab, RANDOM, 0.02f);
    }
    add("output_norm.weight", h, 1, ONES, 0);
    if (m->rope_factor > 0) {
        add("rope_freqs.weight", m->head_dim / 2, 1, ROPE_FREQS, 0);
    }
    add("token_embd.weight", h, m->vocab, RANDOM, 0.02f);
    const int n_global = n_tensors;
    for (int l = 0; l < m->n_layer; l++) {
        char n[64];
#define BLK(s) (snprintf(n, sizeof n, "blk.%d.%s", l, s), n)
        if (m->qkv_bias) {
            add(BLK("attn_k.bias"), kv_dim, 1, RANDOM, 0.02f);
        }
        add(BLK("attn_k.weight"), h, kv_dim, RANDOM, 1 / sqrtf((float)h));
        add(BLK("attn_norm.weight"), h, 1, ONES, 0);
        add(BLK("attn_output.weight"), q_dim, h, RANDOM, 1 / sqrtf((float)q_dim));
        if (m->qkv_bias) {
            add(BLK("attn_q.bias"), q_dim, 1, RANDOM, 0.02f);
        }
        add(BLK("attn_q.weight"), h, q_dim, RANDOM, 1 / sqrtf((float)h));
        if (m->qkv_bias) {
            add(BLK("attn_v.bias"), kv_dim, 1, RANDOM, 0.02f);
        }
        add(BLK("attn_v.weight"), h, kv_dim, RANDOM, 1 / sqrtf((float)h));
        add(BLK("ffn_down.weight"), f, h, RANDOM, 1 / sqrtf((float)f));
        add(BLK("ffn_gate.weight"), h, f, RANDOM, 1 / sqrtf((float)h));
        add(BLK("ffn_norm.weight"), h, 1, ONES, 0);
        add(BLK("ffn_up.weight"), h, f, RANDOM, 1 / sqrtf((float)h));
    }
    const int per_layer = (n_tensors - n_global) / m->n_layer;

    struct ggml_init_params gp = {
        .mem_size = (size_t)n_tensors * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context *meta = ggml_init(gp);
    for (int i = 0; i < n_tensors; i++) {
        struct tensor *t = &tensors[i];
        int layer = i < n_global ? -1 : (i - n_global) / per_layer;
        t->type = pick_type(t, q8, m->tied, layer, m->n_layer);
        struct ggml_tensor *gt = t->ne1 == 1 ? ggml_new_tensor_1d(meta, t->type, t->ne0)
                                             : ggml_new_tensor_2d(meta, t->type, t->ne0, t->ne1);
        ggml_set_name(gt, t->name);
        gguf_add_tensor(g, gt);
    }

    // The metadata, then each tensor at the offset gguf gave it, padded to the alignment.
    FILE *out = fopen(argv[4], "wb");
    if (out == NULL || !gguf_write_to_file_ptr(g, out, /*only_meta=*/true)) {
        die("cannot write ", argv[4]);
    }
    const long data = ftell(out);
    const size_t align = gguf_get_alignment(g);
    static const char zeros[64];
    for (int i = 0; i < n_tensors; i++) {
        long at = data + (long)gguf_get_tensor_offset(g, i);
        if (ftell(out) != at) {
            die("tensor offset mismatch at ", tensors[i].name);
        }
        write_tensor(m, &tensors[i], out);
        write_or_die(zeros, (align - (size_t)(ftell(out) - data) % align) % align, out);
        if (i < n_global) {
            fprintf(stderr, "model-shapes: %s %s: %s, %.2f GiB\n", m->name, argv[2],
                    tensors[i].name, (double)ftell(out) / (1 << 30));
        } else if ((i + 1 - n_global) % per_layer == 0) {
            fprintf(stderr, "model-shapes: %s %s: blk.%d, %.2f GiB\n", m->name, argv[2],
                    (i - n_global) / per_layer, (double)ftell(out) / (1 << 30));
        }
    }
    if (fclose(out) != 0) {
        die("cannot write ", argv[4]);
    }

    // Read it back: the data section and every tensor must sit where gguf says.
    struct gguf_context *check = gguf_init_from_file(argv[4], vp);
    if (check == NULL || gguf_get_n_tensors(check) != n_tensors ||
        gguf_get_data_offset(check) != (size_t)data) {
        die("read-back check failed for ", argv[4]);
    }
    for (int i = 0; i < n_tensors; i++) {
        if (gguf_get_tensor_offset(check, i) != gguf_get_tensor_offset(g, i) ||
            gguf_get_tensor_type(check, i) != tensors[i].type) {
            die("read-back mismatch at ", tensors[i].name);
        }
    }
    gguf_free(check);
    ggml_free(meta);
    gguf_free(g);
    gguf_free(tokenizer);
    gguf_free(vocab);
    return 0;
}
