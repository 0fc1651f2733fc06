/* Decode only the part of a JPEG that a random crop keeps.
 *
 * The inception crop keeps on average about half of an ImageNet-size photo, yet a full decode
 * runs the inverse DCT, upsampling and colour conversion on every pixel. libjpeg-turbo can skip
 * most of that work: jpeg_skip_scanlines() passes over the rows above the crop (entropy decoding
 * only), jpeg_crop_scanline() limits each row to the iMCU columns around the crop, and the rows
 * below it are never read. No Python library exposes these two calls (Pillow, torchvision,
 * simplejpeg and PyTurboJPEG decode whole images or whole scaled images), so this module does.
 *
 * decode_region(data, top, left, height, width) -> bytearray of height * width * 3 bytes, the
 * RGB pixels of rows [top, top + height) and columns [left, left + width), row after row. The
 * pixels are those of a full decode by the same libjpeg: columns on each side of the crop are
 * decoded as well, so that "fancy" chroma upsampling at the crop's edge sees its real neighbours.
 * Raises ValueError for data libjpeg cannot decode (its message); DamagedJPEG (a ValueError) for
 * data it decodes with a warning of damaged entropy-coded data in the crop's rows or above them
 * (a corrupted or cut-short stream; not a header oddity such as an unknown JFIF version, after which
 * the pixels are whole); UnsupportedJPEG for images this path does not handle (CMYK/YCCK). On
 * either of the last two the caller decodes the image whole: a crop sees only its own rows' data, so
 * the verdict on a damaged image must come from one decode of all of it, whatever the crop. The GIL
 * is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h> /* the warnings' codes */

static PyObject *UnsupportedJPEG, *DamagedJPEG;

struct region_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int damage; /* warnings that mean damaged entropy-coded data */
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct region_error *err = (struct region_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings are kept, not printed. Those that mean damaged or missing entropy-coded data fail the
   sample; the others (an unknown JFIF version, a sequential JPEG's odd scan parameters, a bad ICC
   marker, extraneous bytes before a marker) leave whole pixels, which Pillow, torchvision and
   TF's decode_jpeg give as well. */
static int is_damage(int code) {
    return code == JWRN_HIT_MARKER || code == JWRN_JPEG_EOF || code == JWRN_HUFF_BAD_CODE ||
           code == JWRN_ARITH_BAD_CODE || code == JWRN_MUST_RESYNC || code == JWRN_BOGUS_PROGRESSION;
}

static void on_message(j_common_ptr cinfo, int level) {
    struct region_error *err = (struct region_error *)cinfo->err;
    if (level < 0) {
        cinfo->err->num_warnings++;
        if (is_damage(cinfo->err->msg_code) && err->damage++ == 0) {
            (*cinfo->err->format_message)(cinfo, err->message);
        }
    }
}

static void start_error_handling(struct jpeg_decompress_struct *cinfo, struct region_error *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->damage = 0;
    err->message[0] = '\0';
}

enum outcome { DECODED, FAILED, UNSUPPORTED, BAD_REGION };

static enum outcome decode(const unsigned char *data, size_t size, int top, int left, int height, int width,
                           unsigned char *out, struct region_error *err) {
    struct jpeg_decompress_struct cinfo;
    /* volatile: read after a longjmp */
    unsigned char *volatile row = NULL;
    volatile enum outcome result = FAILED;

    start_error_handling(&cinfo, err);
    if (setjmp(err->jump)) {
        free(row);
        jpeg_destroy_decompress(&cinfo);
        return result;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        return UNSUPPORTED;
    }
    if (top < 0 || left < 0 || height <= 0 || width <= 0 || (JDIMENSION)(top + height) > cinfo.image_height ||
        (JDIMENSION)(left + width) > cinfo.image_width) {
        jpeg_destroy_decompress(&cinfo);
        return BAD_REGION;
    }
    cinfo.out_color_space = JCS_RGB;
    jpeg_start_decompress(&cinfo);

    /* The crop plus one column on the left and an iMCU (at most 16 px) on the right (see the
       header comment: a narrower margin changes the last columns of very narrow crops); libjpeg
       moves the start left to an iMCU boundary and says where the decoded columns start. */
    JDIMENSION first = left > 0 ? (JDIMENSION)left - 1 : 0;
    JDIMENSION end = (JDIMENSION)(left + width) + 16 < cinfo.output_width ? (JDIMENSION)(left + width) + 16
                                                                          : cinfo.output_width;
    JDIMENSION decoded_left = first, decoded_width = end - first;
    jpeg_crop_scanline(&cinfo, &decoded_left, &decoded_width);
    row = malloc((size_t)decoded_width * 3);
    if (row == NULL) {
        strcpy(err->message, "out of memory");
        longjmp(err->jump, 1);
    }
    if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) {
        strcpy(err->message, "could not skip to the crop's first row");
        longjmp(err->jump, 1);
    }
    size_t offset = (size_t)(left - (int)decoded_left) * 3, row_bytes = (size_t)width * 3;
    for (int r = 0; r < height; r++) {
        JSAMPROW rows[1] = {row};
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
            strcpy(err->message, "the image ended before the crop's last row");
            longjmp(err->jump, 1);
        }
        memcpy(out + (size_t)r * row_bytes, row + offset, row_bytes);
    }
    free(row);
    row = NULL;
    result = err->damage ? FAILED : DECODED;
    jpeg_abort_decompress(&cinfo); /* the rows below the crop are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return result;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data;
    int top, left, height, width;
    if (!PyArg_ParseTuple(args, "y*iiii:decode_region", &data, &top, &left, &height, &width)) {
        return NULL;
    }
    if (height <= 0 || width <= 0) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "decode_region: empty region %dx%d", width, height);
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)height * width * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    struct region_error err;
    enum outcome result;
    Py_BEGIN_ALLOW_THREADS
    result = decode(data.buf, (size_t)data.len, top, left, height, width,
                    (unsigned char *)PyByteArray_AS_STRING(out), &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (result == DECODED) {
        return out;
    }
    Py_DECREF(out);
    if (result == UNSUPPORTED) {
        PyErr_SetString(UnsupportedJPEG, "CMYK/YCCK JPEG: not decoded by region");
    } else if (result == BAD_REGION) {
        PyErr_Format(PyExc_ValueError, "decode_region: the region %dx%d at (%d, %d) is not inside the image",
                     width, height, left, top);
    } else {
        PyErr_Format(err.damage ? DamagedJPEG : PyExc_ValueError, "corrupt JPEG: %s",
                     err.message[0] ? err.message : "unknown error");
    }
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, top, left, height, width) -> bytearray: the RGB pixels (row-major, 3 bytes "
     "each) of that region of a JPEG, decoding only what the region needs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_region", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_region(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    UnsupportedJPEG = PyErr_NewException("vitray.data._jpeg_region.UnsupportedJPEG", PyExc_ValueError, NULL);
    if (UnsupportedJPEG == NULL || PyModule_AddObjectRef(m, "UnsupportedJPEG", UnsupportedJPEG) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    DamagedJPEG = PyErr_NewException("vitray.data._jpeg_region.DamagedJPEG", PyExc_ValueError, NULL);
    if (DamagedJPEG == NULL || PyModule_AddObjectRef(m, "DamagedJPEG", DamagedJPEG) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
