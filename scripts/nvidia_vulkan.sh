# Sourced by the device scripts that run WebGPU on NVIDIA's Vulkan driver: unpacks the
# Vulkan loader .debs in $1/gl and points the loader at the driver. The device has no X
# server, so the driver is loaded as its EGL library: the GLX one its manifest names
# answers no vkCreateInstance there ("Found no drivers").
for f in "$1"/gl/*.deb; do dpkg -x "$f" /; done
ldconfig
printf '{"file_format_version": "1.0.1", "ICD": {"library_path": "libEGL_nvidia.so.0", "api_version": "1.3.0"}}\n' > /tmp/nvidia_egl_icd.json
export VK_DRIVER_FILES=/tmp/nvidia_egl_icd.json
