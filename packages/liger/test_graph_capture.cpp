// Package liger's CUDA kernels inside a CUDA graph: the calls of a forward and backward, captured on a
// stream and replayed, must give bitwise what the same calls give launched directly (the kernels are
// deterministic).  This checks that nothing in them waits on the host (cross_entropy.h promises a
// capturable cross-entropy) and that the norms' column sums, launched as programmatic dependents of
// their row kernel on sm_90 (kcpp/kernel/column_sums.cuh), keep their order inside a graph.
#include <functional>
#include <string>
#include <vector>

#include "core/cuda_runtime.h"
#include "kernel_params.h"
#include "layer_norm/layer_norm.h"
#include "test_util.h"

namespace kcpp {
namespace {

#if KCPP_WITH_CUDA
// Runs `enqueue` on a fresh stream directly and keeps `outputs`; then captures `enqueue` into a
// graph and replays it twice, the outputs overwritten with 0xff bytes (NaN in every float type)
// before each replay, and compares them with the direct run's.
void expect_graph_replays_as_direct(const std::function<void(cudaStream_t)>& enqueue, const std::vector<Tensor>& outputs,
                                    const std::string& what) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  enqueue(s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess) << what;
  std::vector<std::vector<double>> direct;
  for (const Tensor& t : outputs) direct.push_back(t.to_f64_vector());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  enqueue(s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << what << ": the capture was invalidated";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess) << what;
  for (int replay = 0; replay < 2; ++replay) {
    for (const Tensor& t : outputs) ASSERT_EQ(cudaMemsetAsync(t.data(), 0xff, t.nbytes(), s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess) << what;
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess) << what;
    for (size_t i = 0; i < outputs.size(); ++i)
      EXPECT_EQ(outputs[i].to_f64_vector(), direct[i]) << what << ": output " << i << ", replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(LigerGraphCapture, NormsAndCrossEntropyReplayAsLaunched) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::string tag = test::config_name(dev, dt);
    {  // RMSNorm forward + backward (the bulk path on sm_90, then the column sums)
      const Tensor x = Tensor::randn({989, 4096}, dt, dev, gen), w = Tensor::randn({4096}, dt, dev, gen);
      const test::RMSNormTensors t = test::rms_norm_tensors(x, w, Tensor::randn({989, 4096}, dt, dev, gen));
      liger::RMSNormParams p = test::rms_norm_params(t);
      const Tensor ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace(p, dev.index))}, DType::u8, dev);
      p.workspace = ws.data();
      expect_graph_replays_as_direct([&](cudaStream_t s) {
        test::check(liger::rms_norm_forward_cuda(p, s));
        test::check(liger::rms_norm_backward_cuda(p, s));
      }, {t.y, t.rstd, t.dx, t.dw}, tag + " rms_norm");
    }
    {  // LayerNorm forward + backward with bias (dw and db in one column-sum launch)
      const int64_t rows = 989, h = 2048;
      const Tensor x = Tensor::randn({rows, h}, dt, dev, gen), w = Tensor::randn({h}, dt, dev, gen);
      const Tensor b = Tensor::randn({h}, dt, dev, gen), dy = Tensor::randn({rows, h}, dt, dev, gen);
      const Tensor y = Tensor::empty({rows, h}, dt, dev), dx = Tensor::empty({rows, h}, dt, dev);
      const Tensor mean = Tensor::empty({rows}, DType::f32, dev), rstd = Tensor::empty({rows}, DType::f32, dev);
      const Tensor dw = Tensor::empty({h}, dt, dev), db = Tensor::empty({h}, dt, dev);
      liger::LayerNormParams p;
      p.dtype = test::kernel_dtype(dt), p.rows = rows, p.hidden = h;
      p.x = x.data(), p.x_stride = h, p.w = w.data(), p.b = b.data(), p.y = y.data(), p.y_stride = h;
      p.mean = static_cast<float*>(mean.data()), p.rstd = static_cast<float*>(rstd.data());
      p.dy = dy.data(), p.dy_stride = h, p.dx = dx.data(), p.dx_stride = h, p.dw = dw.data(), p.db = db.data();
      const Tensor ws = Tensor::empty({static_cast<int64_t>(liger::layer_norm_backward_workspace(p, dev.index))}, DType::u8, dev);
      p.workspace = ws.data();
      expect_graph_replays_as_direct([&](cudaStream_t s) {
        test::check(liger::layer_norm_forward_cuda(p, s));
        test::check(liger::layer_norm_backward_cuda(p, s));
      }, {y, mean, rstd, dx, dw, db}, tag + " layer_norm");
    }
    {  // cross-entropy, mean over the non-ignored rows, loss and gradient in one call
      const int64_t n = 257, v = 50257;
      const Tensor logits = Tensor::randn({n, v}, dt, dev, gen);
      std::vector<int64_t> tv(n);
      for (int64_t i = 0; i < n; ++i) tv[i] = i % 7 == 3 ? -100 : (i * 7919) % v;
      const Tensor targets = Tensor::from_i64(tv, {n}, DType::i64, dev);
      const Tensor loss = Tensor::empty({1}, DType::f32, dev), grad = Tensor::empty({n, v}, dt, dev);
      liger::CrossEntropyParams p = test::cross_entropy_params(logits, targets, {}, loss, grad);
      const Tensor ws = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(liger::cross_entropy_workspace(p)))}, DType::u8, dev);
      p.workspace = ws.data();
      expect_graph_replays_as_direct([&](cudaStream_t s) { test::check(liger::cross_entropy_cuda(p, s)); }, {loss, grad},
                                     tag + " cross_entropy");
    }
  }
}
#endif

}  // namespace
}  // namespace kcpp
