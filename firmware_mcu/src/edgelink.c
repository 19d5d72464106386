#include "edgelink.h"

#include <string.h>

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v & 0xFFu);
    p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v & 0xFFu);
    p[1] = (uint8_t)((v >> 8) & 0xFFu);
    p[2] = (uint8_t)((v >> 16) & 0xFFu);
    p[3] = (uint8_t)(v >> 24);
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (uint16_t)(p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Bitwise CRC-32C: no 1 KiB table in flash; a few cycles per bit is plenty at serial rates. */
uint32_t el_crc32c(uint32_t crc, const uint8_t *data, size_t len)
{
    size_t i;
    int bit;
    crc = ~crc;
    for (i = 0; i < len; i++) {
        crc ^= data[i];
        for (bit = 0; bit < 8; bit++) {
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
        }
    }
    return ~crc;
}

el_status el_cobs_encode(const uint8_t *in, size_t in_len, uint8_t *out, size_t out_cap, size_t *out_len)
{
    size_t read = 0, write = 1, code_at = 0;
    uint8_t code = 1;
    if ((in == NULL && in_len > 0) || out == NULL || out_len == NULL) {
        return EL_ERR_ARG;
    }
    if (out_cap < in_len + in_len / 254u + 1u) {
        return EL_ERR_SPACE;
    }
    while (read < in_len) {
        if (in[read] == 0) {
            out[code_at] = code;
            code_at = write++;
            code = 1;
        } else {
            out[write++] = in[read];
            code++;
            /* A full group of 254 starts a new one only if more input follows (as Python's cobs does). */
            if (code == 0xFF && read + 1u < in_len) {
                out[code_at] = code;
                code_at = write++;
                code = 1;
            }
        }
        read++;
    }
    out[code_at] = code;
    *out_len = write;
    return EL_OK;
}

el_status el_cobs_decode(const uint8_t *in, size_t in_len, uint8_t *out, size_t out_cap, size_t *out_len)
{
    size_t read = 0, write = 0;
    if (in == NULL || out == NULL || out_len == NULL) {
        return EL_ERR_ARG;
    }
    while (read < in_len) {
        uint8_t code = in[read++];
        uint8_t i;
        if (code == 0) {
            return EL_ERR_COBS;
        }
        if (read + (size_t)(code - 1u) > in_len) {
            return EL_ERR_COBS;
        }
        if (write + (size_t)(code - 1u) > out_cap) {
            return EL_ERR_SPACE;
        }
        for (i = 1; i < code; i++) {
            if (in[read] == 0) {
                return EL_ERR_COBS;
            }
            out[write++] = in[read++];
        }
        /* A group shorter than 254 data bytes stands for a zero, except at the very end. */
        if (code != 0xFF && read < in_len) {
            if (write >= out_cap) {
                return EL_ERR_SPACE;
            }
            out[write++] = 0;
        }
    }
    *out_len = write;
    return EL_OK;
}

el_status el_frame_encode(uint8_t type, uint16_t seq, const uint8_t *payload, uint16_t len, uint8_t *out,
                          size_t out_cap, size_t *out_len)
{
    uint8_t raw[EL_MAX_FRAME];
    size_t encoded = 0;
    el_status st;
    if (out == NULL || out_len == NULL || (payload == NULL && len > 0)) {
        return EL_ERR_ARG;
    }
    if (len > EL_MAX_PAYLOAD) {
        return EL_ERR_LENGTH;
    }
    raw[0] = EL_VERSION;
    raw[1] = type;
    put_u16(raw + 2, seq);
    put_u16(raw + 4, len);
    if (len > 0) {
        memcpy(raw + EL_HEADER_LEN, payload, len);
    }
    put_u32(raw + EL_HEADER_LEN + len, el_crc32c(0, raw, EL_HEADER_LEN + (size_t)len));
    if (out_cap < 1) {
        return EL_ERR_SPACE;
    }
    st = el_cobs_encode(raw, EL_HEADER_LEN + (size_t)len + EL_CRC_LEN, out, out_cap - 1u, &encoded);
    if (st != EL_OK) {
        return st;
    }
    out[encoded] = 0;
    *out_len = encoded + 1u;
    return EL_OK;
}

void el_decoder_init(el_decoder *d)
{
    if (d != NULL) {
        d->used = 0;
        d->discarding = 0;
    }
}

static el_rx_result finish_frame(el_decoder *d, el_frame *frame)
{
    size_t n = 0;
    uint16_t len;
    if (el_cobs_decode(d->buf, d->used, d->frame, sizeof d->frame, &n) != EL_OK) {
        return EL_RX_BAD_COBS;
    }
    if (n > EL_MAX_FRAME) {
        return EL_RX_TOO_LONG;
    }
    if (n < EL_HEADER_LEN + EL_CRC_LEN) {
        return EL_RX_TOO_SHORT;
    }
    if (el_crc32c(0, d->frame, n - EL_CRC_LEN) != get_u32(d->frame + n - EL_CRC_LEN)) {
        return EL_RX_BAD_CRC;
    }
    if (d->frame[0] != EL_VERSION) {
        return EL_RX_BAD_VERSION;
    }
    len = get_u16(d->frame + 4);
    if ((size_t)len != n - EL_HEADER_LEN - EL_CRC_LEN) {
        return EL_RX_BAD_LENGTH;
    }
    frame->type = d->frame[1];
    frame->seq = get_u16(d->frame + 2);
    frame->len = len;
    frame->payload = d->frame + EL_HEADER_LEN;
    return EL_RX_FRAME;
}

el_rx_result el_decoder_push(el_decoder *d, uint8_t byte, el_frame *frame)
{
    el_rx_result r;
    if (d == NULL || frame == NULL) {
        return EL_RX_PENDING;
    }
    if (byte != 0) {
        if (d->discarding) {
            return EL_RX_PENDING;
        }
        if (d->used >= sizeof d->buf) {
            d->discarding = 1;
            d->used = 0;
            return EL_RX_PENDING;
        }
        d->buf[d->used++] = byte;
        return EL_RX_PENDING;
    }
    if (d->discarding) {
        d->discarding = 0;
        return EL_RX_TOO_LONG;
    }
    if (d->used == 0) {
        return EL_RX_PENDING; /* idle delimiters between frames */
    }
    r = finish_frame(d, frame);
    d->used = 0;
    return r;
}

const char *el_rx_result_name(el_rx_result r)
{
    switch (r) {
    case EL_RX_PENDING: return "pending";
    case EL_RX_FRAME: return "frame";
    case EL_RX_TOO_LONG: return "too_long";
    case EL_RX_BAD_COBS: return "bad_cobs";
    case EL_RX_TOO_SHORT: return "too_short";
    case EL_RX_BAD_CRC: return "bad_crc";
    case EL_RX_BAD_VERSION: return "bad_version";
    case EL_RX_BAD_LENGTH: return "bad_length";
    }
    return "unknown";
}

el_status el_payload_encode(const el_message *m, uint8_t *out, size_t out_cap, size_t *out_len)
{
    size_t n;
    int i;
    if (m == NULL || out == NULL || out_len == NULL) {
        return EL_ERR_ARG;
    }
    switch (m->type) {
    case EL_MSG_HELLO: n = EL_HELLO_LEN; break;
    case EL_MSG_DETECTION: n = EL_DETECTION_LEN; break;
    case EL_MSG_HEARTBEAT: n = EL_HEARTBEAT_LEN; break;
    case EL_MSG_LOG:
        if (m->u.log.text_len > EL_MAX_LOG) {
            return EL_ERR_LENGTH;
        }
        n = 1u + m->u.log.text_len;
        break;
    case EL_MSG_OTA_BEGIN: n = EL_OTA_BEGIN_LEN; break;
    case EL_MSG_OTA_CHUNK:
        if (m->u.ota_chunk.len == 0 || m->u.ota_chunk.len > EL_MAX_CHUNK || m->u.ota_chunk.data == NULL) {
            return EL_ERR_LENGTH;
        }
        n = EL_OTA_CHUNK_HEADER + m->u.ota_chunk.len;
        break;
    case EL_MSG_OTA_END: n = 0; break;
    case EL_MSG_ACK:
    case EL_MSG_NACK: n = EL_ACK_LEN; break;
    default: return EL_ERR_TYPE;
    }
    if (out_cap < n) {
        return EL_ERR_SPACE;
    }
    switch (m->type) {
    case EL_MSG_HELLO:
        put_u32(out, m->u.hello.device_id);
        put_u32(out + 4, m->u.hello.fw_version);
        put_u32(out + 8, m->u.hello.model_version);
        put_u16(out + 12, m->u.hello.frame_width);
        put_u16(out + 14, m->u.hello.frame_height);
        out[16] = m->u.hello.active_slot;
        out[17] = m->u.hello.flags;
        put_u16(out + 18, 0);
        memcpy(out + 20, m->u.hello.model_name, EL_MODEL_NAME_LEN);
        break;
    case EL_MSG_DETECTION:
        put_u32(out, m->u.detection.timestamp_ms);
        put_u16(out + 4, m->u.detection.class_id);
        put_u16(out + 6, m->u.detection.score_q16);
        for (i = 0; i < 4; i++) {
            put_u16(out + 8 + 2 * i, m->u.detection.box[i]);
        }
        break;
    case EL_MSG_HEARTBEAT:
        put_u32(out, m->u.heartbeat.uptime_ms);
        put_u32(out + 4, m->u.heartbeat.detections_sent);
        put_u32(out + 8, m->u.heartbeat.detections_dropped);
        put_u32(out + 12, m->u.heartbeat.rx_bad_frames);
        break;
    case EL_MSG_LOG:
        out[0] = m->u.log.level;
        memcpy(out + 1, m->u.log.text, m->u.log.text_len);
        break;
    case EL_MSG_OTA_BEGIN:
        memcpy(out, m->u.ota_begin.manifest, EL_MANIFEST_LEN);
        memcpy(out + EL_MANIFEST_LEN, m->u.ota_begin.key_id, EL_KEY_ID_LEN);
        memcpy(out + EL_MANIFEST_LEN + EL_KEY_ID_LEN, m->u.ota_begin.signature, EL_SIGNATURE_LEN);
        break;
    case EL_MSG_OTA_CHUNK:
        put_u32(out, m->u.ota_chunk.offset);
        memcpy(out + EL_OTA_CHUNK_HEADER, m->u.ota_chunk.data, m->u.ota_chunk.len);
        break;
    case EL_MSG_ACK:
    case EL_MSG_NACK:
        out[0] = m->u.ack.acked_type;
        out[1] = m->u.ack.reason;
        put_u16(out + 2, m->u.ack.acked_seq);
        put_u32(out + 4, m->u.ack.value);
        break;
    default: break;
    }
    *out_len = n;
    return EL_OK;
}

el_status el_message_encode(const el_message *m, uint8_t *out, size_t out_cap, size_t *out_len)
{
    uint8_t payload[EL_MAX_PAYLOAD];
    size_t n = 0;
    el_status st;
    if (m == NULL) {
        return EL_ERR_ARG;
    }
    st = el_payload_encode(m, payload, sizeof payload, &n);
    if (st != EL_OK) {
        return st;
    }
    return el_frame_encode(m->type, m->seq, payload, (uint16_t)n, out, out_cap, out_len);
}

el_status el_message_decode(const el_frame *f, el_message *m)
{
    const uint8_t *p;
    int i;
    if (f == NULL || m == NULL || (f->payload == NULL && f->len > 0)) {
        return EL_ERR_ARG;
    }
    p = f->payload;
    memset(m, 0, sizeof *m);
    m->type = f->type;
    m->seq = f->seq;
    switch (f->type) {
    case EL_MSG_HELLO:
        if (f->len != EL_HELLO_LEN) {
            return EL_ERR_LENGTH;
        }
        m->u.hello.device_id = get_u32(p);
        m->u.hello.fw_version = get_u32(p + 4);
        m->u.hello.model_version = get_u32(p + 8);
        m->u.hello.frame_width = get_u16(p + 12);
        m->u.hello.frame_height = get_u16(p + 14);
        m->u.hello.active_slot = p[16];
        m->u.hello.flags = p[17];
        memcpy(m->u.hello.model_name, p + 20, EL_MODEL_NAME_LEN);
        return EL_OK;
    case EL_MSG_DETECTION:
        if (f->len != EL_DETECTION_LEN) {
            return EL_ERR_LENGTH;
        }
        m->u.detection.timestamp_ms = get_u32(p);
        m->u.detection.class_id = get_u16(p + 4);
        m->u.detection.score_q16 = get_u16(p + 6);
        for (i = 0; i < 4; i++) {
            m->u.detection.box[i] = get_u16(p + 8 + 2 * i);
        }
        return EL_OK;
    case EL_MSG_HEARTBEAT:
        if (f->len != EL_HEARTBEAT_LEN) {
            return EL_ERR_LENGTH;
        }
        m->u.heartbeat.uptime_ms = get_u32(p);
        m->u.heartbeat.detections_sent = get_u32(p + 4);
        m->u.heartbeat.detections_dropped = get_u32(p + 8);
        m->u.heartbeat.rx_bad_frames = get_u32(p + 12);
        return EL_OK;
    case EL_MSG_LOG:
        if (f->len < 1u || f->len > 1u + EL_MAX_LOG) {
            return EL_ERR_LENGTH;
        }
        m->u.log.level = p[0];
        m->u.log.text_len = (uint16_t)(f->len - 1u);
        memcpy(m->u.log.text, p + 1, m->u.log.text_len);
        return EL_OK;
    case EL_MSG_OTA_BEGIN:
        if (f->len != EL_OTA_BEGIN_LEN) {
            return EL_ERR_LENGTH;
        }
        memcpy(m->u.ota_begin.manifest, p, EL_MANIFEST_LEN);
        memcpy(m->u.ota_begin.key_id, p + EL_MANIFEST_LEN, EL_KEY_ID_LEN);
        memcpy(m->u.ota_begin.signature, p + EL_MANIFEST_LEN + EL_KEY_ID_LEN, EL_SIGNATURE_LEN);
        return EL_OK;
    case EL_MSG_OTA_CHUNK:
        if (f->len <= EL_OTA_CHUNK_HEADER || f->len > EL_OTA_CHUNK_HEADER + EL_MAX_CHUNK) {
            return EL_ERR_LENGTH;
        }
        m->u.ota_chunk.offset = get_u32(p);
        m->u.ota_chunk.len = (uint16_t)(f->len - EL_OTA_CHUNK_HEADER);
        m->u.ota_chunk.data = p + EL_OTA_CHUNK_HEADER;
        return EL_OK;
    case EL_MSG_OTA_END:
        return f->len == 0 ? EL_OK : EL_ERR_LENGTH;
    case EL_MSG_ACK:
    case EL_MSG_NACK:
        if (f->len != EL_ACK_LEN) {
            return EL_ERR_LENGTH;
        }
        m->u.ack.acked_type = p[0];
        m->u.ack.reason = p[1];
        m->u.ack.acked_seq = get_u16(p + 2);
        m->u.ack.value = get_u32(p + 4);
        return EL_OK;
    default:
        return EL_ERR_TYPE;
    }
}
