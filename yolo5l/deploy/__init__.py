"""Deployment formats beyond ONNX and TorchScript: writers and runners, one module per format.

`yolo5l.export` writes them (`format=openvino|tflite|ncnn|coreml|engine`, `nms=true` for an end-to-end ONNX);
`yolo5l.deploy.exported.ExportedModel` runs them, which is how `python -m yolo5l.val` and `python -m yolo5l.predict`
take them as `weights=`. Each format's tools are an extra of the package (`yolo5l.deploy.formats.FORMATS`).
"""
