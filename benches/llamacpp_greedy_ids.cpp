// Greedy token ids from llama.cpp itself, for the fixtures of gpu/tests/llamacpp_tokens.rs.
//
// Takes the prompt as token ids (so tokenization is not part of the comparison), runs it as
// one batch, then decodes N tokens greedily one at a time (end-of-generation tokens do not
// stop it), and prints the generated ids on one line. KV cache in f32 and flash attention off
// by default (pdserve's default KV cache and attention are f32); `--kv f16 --fa` gives
// llama.cpp's own defaults.
//
// Build against a llama.cpp build tree (docs/benchmarks.md has the recipe):
//   g++ -O2 -std=c++17 benches/llamacpp_greedy_ids.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//       -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin -o greedy_ids
// Run: greedy_ids -m MODEL.gguf -n 40 -t 2 [--kv f16] [--fa] ID ID ID ...
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    std::string model_path;
    int n_predict = 40, threads = 2;
    bool kv_f16 = false, fa = false;
    std::vector<llama_token> prompt;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc) model_path = argv[++i];
        else if (!strcmp(argv[i], "-n") && i + 1 < argc) n_predict = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-t") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc) kv_f16 = !strcmp(argv[++i], "f16");
        else if (!strcmp(argv[i], "--fa")) fa = true;
        else prompt.push_back(atoi(argv[i]));
    }
    if (model_path.empty() || prompt.empty()) {
        fprintf(stderr, "usage: %s -m MODEL -n N [-t T] [--kv f16] [--fa] ID...\n", argv[0]);
        return 1;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) return 1;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = prompt.size() + n_predict + 8;
    cp.n_batch = prompt.size();
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = kv_f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    cp.type_v = kv_f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    auto set = [&](const llama_token * t, int n, llama_pos pos0) {
        llama_batch_ext_clear(batch);
        for (int i = 0; i < n; i++) {
            int idx = llama_batch_ext_add_token(batch, 0, t[i]);
            llama_pos p = pos0 + i;
            llama_batch_ext_set_pos(batch, idx, &p);
        }
        llama_batch_ext_set_output_logits(batch, n - 1, true);
    };
    set(prompt.data(), prompt.size(), 0);
    int pos = 0, n_tokens = prompt.size();
    for (int i = 0; i < n_predict; i++) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) return 1;
        pos += n_tokens;
        llama_token id = llama_sampler_sample(smpl, ctx, -1);
        printf(i ? " %d" : "%d", id);
        set(&id, 1, pos);
        n_tokens = 1;
    }
    printf("\n");
    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
