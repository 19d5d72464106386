#include "el_describe.h"

#include <stdio.h>

void el_hex(const uint8_t *data, size_t len, char *out)
{
    static const char digits[] = "0123456789abcdef";
    size_t i;
    for (i = 0; i < len; i++) {
        out[2 * i] = digits[data[i] >> 4];
        out[2 * i + 1] = digits[data[i] & 0xF];
    }
    out[2 * len] = '\0';
}

int el_describe(const el_message *m, char *out, size_t cap)
{
    char a[2 * EL_MAX_PAYLOAD + 1], b[2 * EL_KEY_ID_LEN + 1], c[2 * EL_SIGNATURE_LEN + 1];
    int n;
    switch (m->type) {
    case EL_MSG_HELLO:
        el_hex((const uint8_t *)m->u.hello.model_name, EL_MODEL_NAME_LEN, a);
        n = snprintf(out, cap, "hello device_id=%lu fw_version=%lu model_version=%lu frame=%ux%u slot=%u flags=%u name=%s",
                     (unsigned long)m->u.hello.device_id, (unsigned long)m->u.hello.fw_version,
                     (unsigned long)m->u.hello.model_version, m->u.hello.frame_width, m->u.hello.frame_height,
                     m->u.hello.active_slot, m->u.hello.flags, a);
        break;
    case EL_MSG_DETECTION:
        n = snprintf(out, cap, "detection ts=%lu class=%u score_q16=%u box=%u,%u,%u,%u",
                     (unsigned long)m->u.detection.timestamp_ms, m->u.detection.class_id, m->u.detection.score_q16,
                     m->u.detection.box[0], m->u.detection.box[1], m->u.detection.box[2], m->u.detection.box[3]);
        break;
    case EL_MSG_HEARTBEAT:
        n = snprintf(out, cap, "heartbeat uptime=%lu sent=%lu dropped=%lu rx_bad=%lu",
                     (unsigned long)m->u.heartbeat.uptime_ms, (unsigned long)m->u.heartbeat.detections_sent,
                     (unsigned long)m->u.heartbeat.detections_dropped, (unsigned long)m->u.heartbeat.rx_bad_frames);
        break;
    case EL_MSG_LOG:
        el_hex((const uint8_t *)m->u.log.text, m->u.log.text_len, a);
        n = snprintf(out, cap, "log level=%u text=%s", m->u.log.level, a);
        break;
    case EL_MSG_OTA_BEGIN:
        el_hex(m->u.ota_begin.manifest, EL_MANIFEST_LEN, a);
        el_hex(m->u.ota_begin.key_id, EL_KEY_ID_LEN, b);
        el_hex(m->u.ota_begin.signature, EL_SIGNATURE_LEN, c);
        n = snprintf(out, cap, "ota_begin manifest=%s key_id=%s sig=%s", a, b, c);
        break;
    case EL_MSG_OTA_CHUNK:
        el_hex(m->u.ota_chunk.data, m->u.ota_chunk.len, a);
        n = snprintf(out, cap, "ota_chunk offset=%lu data=%s", (unsigned long)m->u.ota_chunk.offset, a);
        break;
    case EL_MSG_OTA_END:
        n = snprintf(out, cap, "ota_end");
        break;
    case EL_MSG_ACK:
    case EL_MSG_NACK:
        n = snprintf(out, cap, "%s type=%u reason=%u seq=%u value=%lu", m->type == EL_MSG_ACK ? "ack" : "nack",
                     m->u.ack.acked_type, m->u.ack.reason, m->u.ack.acked_seq, (unsigned long)m->u.ack.value);
        break;
    default:
        n = snprintf(out, cap, "type=%u", m->type);
        break;
    }
    return (n < 0 || (size_t)n >= cap) ? -1 : 0;
}
