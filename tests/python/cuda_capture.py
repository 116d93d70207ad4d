"""A helper of the GPU tests: a call that must be refused while a CUDA graph is being captured."""
import pytest


def refused_under_capture(torch, call, exc, match):
    """call() inside torch.cuda.graph (on a side stream, as torch's CUDA graph notes ask) raises exc
    matching match."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(exc, match=match):
            with torch.cuda.graph(g):
                call()
    torch.cuda.current_stream().wait_stream(side)
