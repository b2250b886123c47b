// The target's next-token logits after one prompt, as llama.cpp computes them in three batch shapes, written side by
// side: what benchmarks/llamacpp_batch_rows.py compares (its docstring says why). Built against the llama.cpp that
// scripts/build_llamacpp.sh builds; run by that script, not by hand.
//
//   llamacpp_rows MODEL THREADS PROMPT_IDS DRAFT_IDS OUT
//
// PROMPT_IDS, DRAFT_IDS: comma-separated token ids. OUT receives three float32 rows of the vocabulary's size, in
// this order:
//   whole   the whole prompt decoded as one batch, the last position's logits (how llama-server starts a request);
//   single  the prompt but its last token decoded first, then the last token alone;
//   verify  the prompt but its last token decoded first, then [last token, drafts...] as one batch with every
//           position's logits asked for, the first position's (how llama-speculative-simple verifies its first
//           drafted step: examples/speculative-simple/speculative-simple.cpp l. 129 and l. 223-228).

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static std::vector<llama_token> parse_ids(const char * text) {
    std::vector<llama_token> ids;
    std::stringstream stream(text);
    std::string item;
    while (std::getline(stream, item, ',')) {
        if (!item.empty()) {
            ids.push_back((llama_token) std::atoi(item.c_str()));
        }
    }
    return ids;
}

// Decode tokens[0..n) at positions start.. as one batch, logits for the positions in `want` (indices into the batch).
static bool decode(llama_context * ctx, const std::vector<llama_token> & tokens, int start, const std::vector<int> & want) {
    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = start + (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 0;
    }
    for (int i : want) {
        batch.logits[i] = 1;
    }
    batch.n_tokens = (int32_t) tokens.size();
    const int32_t status = llama_decode(ctx, batch);
    llama_batch_free(batch);
    return status == 0;
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: %s MODEL THREADS PROMPT_IDS DRAFT_IDS OUT\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const std::vector<llama_token> prompt = parse_ids(argv[3]);
    const std::vector<llama_token> drafts = parse_ids(argv[4]);
    if (prompt.size() < 2) {
        std::fprintf(stderr, "the prompt needs two tokens or more\n");
        return 2;
    }

    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        std::fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = 512;
    params.n_batch = 512;
    params.n_threads = threads;
    params.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, params);
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n = (int) prompt.size();
    const std::vector<llama_token> head(prompt.begin(), prompt.end() - 1);
    std::vector<llama_token> verify = {prompt.back()};
    verify.insert(verify.end(), drafts.begin(), drafts.end());

    std::vector<float> rows;
    auto keep = [&](int index) {
        const float * logits = llama_get_logits_ith(ctx, index);
        rows.insert(rows.end(), logits, logits + vocab);
    };
    bool ok = decode(ctx, prompt, 0, {n - 1});
    if (ok) keep(n - 1);
    llama_memory_clear(llama_get_memory(ctx), true);
    ok = ok && decode(ctx, head, 0, {}) && decode(ctx, {prompt.back()}, n - 1, {0});
    if (ok) keep(0);
    llama_memory_clear(llama_get_memory(ctx), true);
    std::vector<int> every(verify.size());
    for (size_t i = 0; i < verify.size(); ++i) every[i] = (int) i;  // as the example asks: every position's logits
    ok = ok && decode(ctx, head, 0, {}) && decode(ctx, verify, n - 1, every);
    if (ok) keep(0);
    if (!ok) {
        std::fprintf(stderr, "llama_decode failed\n");
        return 1;
    }

    FILE * out = std::fopen(argv[5], "wb");
    if (out == nullptr || std::fwrite(rows.data(), sizeof(float), rows.size(), out) != rows.size()) {
        std::fprintf(stderr, "could not write %s\n", argv[5]);
        return 1;
    }
    std::fclose(out);
    std::printf("%d\n", vocab);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
